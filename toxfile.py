"""tox plugin: one `model-<suite>` environment per suite file, with no hand edits.

tox 4 refuses environment names that no section defines, so we declare them (``tox_extend_envs``)
and seed each with its command (in-memory loaders win over tox.ini's [testenv]). Dropping
``suites/foo.toml`` in makes ``tox -e model-foo`` exist; ``tox -l`` lists them all.
"""

from __future__ import annotations

from pathlib import Path

from tox.config.loader.memory import MemoryLoader
from tox.config.types import Command, EnvList
from tox.plugin import impl

SUITES = Path(__file__).parent / "suites"


def _suites() -> list[str]:
    return sorted(p.stem for p in SUITES.glob("*.toml"))


@impl
def tox_extend_envs():
    return [f"model-{s}" for s in _suites()]


@impl
def tox_add_core_config(core_conf, state) -> None:
    names = [f"model-{s}" for s in _suites()]
    # `tox -l` lists the default env_list: the test env plus every suite's env.
    core_conf.loaders.insert(0, MemoryLoader(env_list=EnvList(["tests", *names])))
    posargs = list(state.conf.pos_args(None) or [])
    for s, name in zip(_suites(), names, strict=True):
        state.conf.memory_seed_loaders[name].append(MemoryLoader(
            description=f"run suite {s} (suites/{s}.toml) through pytest; args after -- go to pytest",
            # one shared virtualenv for all suites: they need the same packages
            env_dir=Path(core_conf["work_dir"]) / "models",
            commands=[Command(["pytest", str(SUITES / f"{s}.toml"), "-p", "no:cacheprovider",
                               f"--junitxml={core_conf['work_dir']}/results/junit-{s}.xml", *posargs])],
        ))
