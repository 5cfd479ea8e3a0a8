"""The user-facing verbs over the simulator core: ``plan`` (capacity), ``sweep``, ``compare``,
``engines`` (one workload through several engine presets); ``slo`` (SLO terms they check) and
``parallel`` (many simulations on local processes or Ray). ``validate`` and ``calibrate`` live in
the calibration package, as they need the kernels. The core (``servesim.sim``) imports none of
this; ``cli.py`` is the only module above it.
"""
