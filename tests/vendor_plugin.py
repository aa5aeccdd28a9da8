"""A vendor's package as `pip install` leaves it: a package plus a dist-info whose entry_points.txt
registers a check, a backend with its own op list, a model builder, an issue sink and a serving-engine
build - through the same five entry-point groups harness's own built-ins use. Nothing in harness is edited."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PACKAGE = '''
import json
import os
from pathlib import Path

from harness.backends import Backend
from harness.checks import Check, CheckFailure
from harness.compare.sinks import SinkType, StdoutSink
from harness.models.build import build_model
from harness.models.builders import Builder

HERE = Path(__file__).resolve().parent


class VendorCheck(Check):
    name = "vendorcheck"
    headline = ("vendor_params",)
    steps = ("build", "measure")
    setup_steps = ("build",)

    def build(self, ctx, st):
        st.model, _ = build_model(ctx.suite, ctx.dtype, ctx.device, seed=0)

    def measure(self, ctx, st):
        ctx.metric("vendor_params", sum(p.numel() for p in st.model.parameters()))
        if not getattr(st.model, "built_by_vendor", False):
            raise CheckFailure("the model did not come from the vendor's builder")
        if ctx.dtype == "bfloat16":
            raise CheckFailure("vendor kernel mismatch in bfloat16")


def build(config, *, dtype, device):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    model.built_by_vendor = True
    return model


class FileLogSink(StdoutSink):
    """Records every action as one JSON line in <out_dir>/vendor-sink.jsonl."""

    def __init__(self, folder):
        super().__init__(open(os.devnull, "w"))
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "vendor-sink.jsonl")

    def create(self, title, body, labels):
        with open(self.path, "a") as f:
            f.write(json.dumps({"op": "create", "title": title}) + "\\n")
        return super().create(title, body, labels)


def register_checks(registry):
    registry.add(VendorCheck())


def register_backends(registry):
    registry.add(Backend("mydev", "mydev", "mccl", module="torch_mydev_not_here", dispatch_key="PrivateUse1",
                         description="Vendor X accelerator", op_lists=[HERE / "mydev-1.0.txt"]))


def register_models(registry):
    registry.add(Builder("vendormodel", build, description="Vendor X's build of the model"))


def register_engines(registry):
    # vLLM with Vendor X's platform plugin, for backend mydev: what `--engine vllm --backend mydev` runs.
    # Its pins are the vendor's own file; the runner is harness's vLLM runner (bare name).
    from harness.serve.engine import Engine

    registry.add(Engine("vllm-mydev", str(HERE / "vllm-mydev.txt"), "vllm_runner.py", engine="vllm",
                        architectures=frozenset({"LlamaForCausalLM"}), backends=frozenset({"mydev"}),
                        plugin="vllm_mydev", platform="mydev", description="vLLM with Vendor X's platform plugin"))


def register_sinks(registry):
    registry.add(SinkType("vendorlog", lambda opts, out: FileLogSink(opts.out_dir), "a JSON line per action"))
'''

OPLIST = """# backend: mydev
# version: 1.0
# source: vendorx/torch_mydev mydev_functions.yaml @ v1.0
aten::mm
aten.addmm.default
aten::add.Tensor fallback
"""

ENTRY_POINTS = """[harness.checks]
vendorcheck = harness_mydev:register_checks

[harness.backends]
mydev = harness_mydev:register_backends

[harness.models]
vendormodel = harness_mydev:register_models

[harness.sinks]
vendorlog = harness_mydev:register_sinks

[harness.engines]
vllm-mydev = harness_mydev:register_engines
"""

# the vendor's engine pins: nothing to install here (a real one pins vllm and its plugin, vllm-mydev==1.0),
# so that `harness engine setup` gets as far as importing the platform plugin, which is not there
ENGINE_PINS = "# vLLM with Vendor X's plugin: vllm==0.32.0 and vllm-mydev==1.0 on the vendor's index\n"


def _dist(site: Path, name: str, entry_points: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


def vendor_site(root: Path, broken: bool = False) -> Path:
    """``root/site`` holding the vendor package (and with ``broken``, a second distribution whose
    check entry point does not import)."""
    site = root / "site"
    pkg = site / "harness_mydev"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PACKAGE)
    (pkg / "mydev-1.0.txt").write_text(OPLIST)
    (pkg / "vllm-mydev.txt").write_text(ENGINE_PINS)
    _dist(site, "harness_mydev", ENTRY_POINTS)
    if broken:
        _dist(site, "harness_broken", "[harness.checks]\nbrokencheck = harness_broken_not_there:register\n")
    return site


def harness(*args, cwd: Path, site: Path | None = None, env: dict | None = None, timeout: int = 600):
    """The ``harness`` console script in a subprocess, with ``site`` on its PYTHONPATH."""
    exe = Path(sys.executable).with_name("harness")
    e = {k: v for k, v in os.environ.items() if k != "HARNESS_CONFIG"}  # cwd's harness.toml, if any
    e |= {"HF_HUB_OFFLINE": "1", "COLUMNS": "200"} | (env or {})
    if site is not None:
        e["PYTHONPATH"] = str(site) + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([str(exe), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
