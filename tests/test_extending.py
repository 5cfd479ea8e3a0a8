"""Adding a policy or an engine preset is one file plus one registry line (issue 14).

Each test writes the one file into a temporary folder and runs, in a fresh interpreter, the one
registry line and then a scenario that uses the new name, as a user's own module would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

TOY_POLICY = '''
"""One request at a time, its whole KV reserved up front: the smallest policy there is."""
from typing import Literal

import numpy as np

from servesim.sim.schedulers.base import PolicyConfig, Scheduler


class OneAtATimeConfig(PolicyConfig):
    type: Literal["one_at_a_time"] = "one_at_a_time"


class OneAtATimeScheduler(Scheduler):
    config_type = OneAtATimeConfig

    def schedule(self, now):
        run = self.run
        if run.n == 0 and self.waiting and self.kv.allocate(self.waiting[0], self.max_kv_tokens(self.waiting[0])):
            self._admit(self.waiting.popleft(), now)
        rows = np.arange(run.n, dtype=np.int64)
        return self._make_batch(rows, run.tokens[: run.n] - run.computed[: run.n])
'''

TOY_ENGINE = '''
"""A made-up engine whose one knob is a token budget; it schedules as chunked prefill does."""
from typing import ClassVar, Literal

from pydantic import Field

from servesim.sim.engine_presets.base import EnginePreset
from servesim.sim.schedulers import ChunkedConfig


class ToyEnginePreset(EnginePreset):
    ENGINE: ClassVar[str] = "Toy engine"
    KV_DEFAULTS: ClassVar[dict] = {"block_size": 32, "watermark": 0.0}

    preset: Literal["toy-engine"] = "toy-engine"
    token_budget: int = Field(512, ge=1)

    def translate(self, hardware, model):
        return ChunkedConfig(max_num_seqs=64, max_num_batched_tokens=self.token_budget)
'''

RUN = '''
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
{registry_line}
from servesim.sim.scenario import scenario_from_dict, scenario_to_yaml
from servesim.sim.simulate import simulate

sc = scenario_from_dict({{"model": "tiny", "hardware": "cpu-2core", "scheduler": {section},
                         "kv_cache": {{"num_blocks": 400}},
                         "workload": {{"num_requests": 30, "arrival": {{"process": "poisson", "rate": 4.0}},
                                      "prompt_len": {{"dist": "uniform", "min": 16, "max": 64}},
                                      "output_len": {{"dist": "uniform", "min": 4, "max": 16}}}}}})
res = simulate(sc, progress=False)
print(json.dumps({{"header": res.header(), "completed": res.summary["completed"],
                  "max_batch": int(res.iterations_df["batch_size"].max()),
                  "block_size": res.kv.block_size, "yaml": scenario_to_yaml(sc)}}))
'''


def _run(tmp_path: Path, module: str, source: str, registry_line: str, section: dict) -> dict:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))  # the one file
    script = RUN.format(registry_line=registry_line, section=repr(section))
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_toy_policy_is_one_file_and_one_registry_line(tmp_path: Path):
    line = ("from servesim.sim.schedulers import POLICIES; import toy_policy; "
            "POLICIES['one_at_a_time'] = toy_policy.OneAtATimeScheduler")
    out = _run(tmp_path, "toy_policy", TOY_POLICY, line, {"type": "one_at_a_time"})
    assert out["header"]["scheduler"] == "one_at_a_time"
    assert out["completed"] == 30
    assert out["max_batch"] == 1


def test_a_toy_engine_preset_is_one_file_and_one_registry_line(tmp_path: Path):
    line = ("from servesim.sim.engine_presets import PRESETS; import toy_engine; "
            "PRESETS['toy-engine'] = toy_engine.ToyEnginePreset")
    out = _run(tmp_path, "toy_engine", TOY_ENGINE, line, {"preset": "toy-engine", "token_budget": 256})
    assert out["header"]["scheduler"] == "toy-engine"
    assert out["completed"] == 30
    assert out["block_size"] == 32  # the preset's KV default
    # the run folder's scenario shows the preset with its knobs and the policy it resolved to
    assert "preset: toy-engine" in out["yaml"] and "token_budget: 256" in out["yaml"]
    assert "resolved_scheduler:\n  type: chunked" in out["yaml"] and "max_num_batched_tokens: 256" in out["yaml"]
