"""Project-level settings: ``harness.toml`` at the repository root (or the file named by the
``HARNESS_CONFIG`` environment variable). Every key is declared with type, default and description.

Example::

    suites_dir = "suites"
    [[backends]]             # a vendor backend harness does not ship
    name = "mydev"
    module = "torch_mydev"   # imported first; absent -> items skip with the import error
    device_type = "mydev"
    collective = "mccl"
    dispatch_key = "PrivateUse1"
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from harness import toml


class CustomBackend(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="Name used by suites and --backend.")
    device_type: str = Field(description="torch device type (after any PrivateUse1 rename).")
    collective: str = Field("gloo", description="torch.distributed backend for parallel checks.")
    module: str | None = Field(None, description="Python module to import before use (the vendor's torch plugin).")
    dispatch_key: str | None = Field(None, description="Dispatcher key of its kernels, e.g. PrivateUse1.")
    description: str = Field("", description="Free text shown by `harness backends`.")
    op_list: str | None = Field(
        None, description="Declared operator list (one aten overload per line, see docs/inspect.md), relative "
        "to this file; used by `harness inspect` and the ops check when the backend is not installed.")


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    suites_dir: str = Field("suites", description="Where suite TOML files live.")
    golden_dir: str = Field("golden", description="Where goldens live.")
    results_dir: str = Field("results", description="Where `harness run` writes JUnit XML and summaries.")
    durations_file: str = Field("durations.json", description="Recorded item durations (`harness durations "
                                "update`): time limits of isolated items and shard balance.")
    backends: list[CustomBackend] = Field(default_factory=list, description="Custom backends.")


class SettingsError(Exception):
    pass


def settings_path() -> Path | None:
    env = os.environ.get("HARNESS_CONFIG")
    if env:
        return Path(env)
    p = Path("harness.toml")
    return p if p.exists() else None


@functools.cache
def _load(path: str | None) -> Settings:
    if path is None:
        return Settings()
    p = Path(path)
    try:
        data = toml.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise SettingsError(f"{p}: cannot read harness settings: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except toml.TOMLDecodeError as e:
        raise SettingsError(f"{p}: not valid TOML: {e}") from None
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        msgs = [f"{p}: {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise SettingsError("\n".join(msgs)) from None


def load_settings() -> Settings:
    p = settings_path()
    return _load(str(p) if p else None)
