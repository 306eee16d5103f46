"""`import trl` and the process (common/trl_import.py): TRL sets VLLM_LOGGING_LEVEL=ERROR where it is unset (a vLLM
worker started after it would log errors only); trl_module imports TRL's helpers and leaves the variable as it was.
Nothing of the trainer imports trl until a tool run starts. In a fresh interpreter (this one may have trl already)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

PROBE = """
import json, os, sys
os.environ.pop("VLLM_LOGGING_LEVEL", None)
import trainer.tools, trainer.tools.multi_turn, trainer.check  # noqa: F401 - what a tool run imports before it starts
before = "trl" in sys.modules
from common.trl_import import trl_module
ctu = trl_module("chat_template_utils")
ours = os.environ.get("VLLM_LOGGING_LEVEL")
from trl._compat import _patch_vllm_logging
_patch_vllm_logging()  # what `import trl` itself did
print(json.dumps({"before": before, "ours": ours, "trl": os.environ.get("VLLM_LOGGING_LEVEL"),
                  "parse": callable(ctu.parse_response)}))
"""


def test_trl_is_imported_lazily_and_leaves_vllm_logging_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"before": False, "ours": None, "trl": "ERROR", "parse": True}
