"""servesim.sim: the simulator and everything simulation and live mode share."""
