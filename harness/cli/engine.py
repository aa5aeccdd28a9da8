"""`harness engine setup|show`: the serving engines' own environments (docs/serving.md)."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("engine", help="serving engines: set up their environments, list them")
    es = p.add_subparsers(dest="engine_command", metavar="ACTION")
    s = es.add_parser("setup", help="create the engine's venv under .harness/engines/NAME from its pins "
                      "(a no-op when it is there and made from the same pins); a build declared with an "
                      "existing environment's python: check that the engine and its plugin import there")
    s.add_argument("name", help="engine build or engine name (harness engine show lists them)")
    s.add_argument("--backend", default=None, help="the build of engine NAME for this backend (--engine vllm "
                   "--backend npu: the vendor's vllm build for npu)")
    s.add_argument("--root", default=None, help="where engine environments live (default: .harness/engines)")
    s.set_defaults(func=setup)
    sh = es.add_parser("show", help="list the engines and whether their environment exists")
    sh.add_argument("--root", default=None, help="where engine environments live (default: .harness/engines)")
    sh.set_defaults(func=show)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def setup(args) -> int:
    from harness.serve import engine as eng

    try:
        e = eng.resolve(args.name, args.backend) if args.backend else eng.get(args.name)
        if not eng.setup(e, args.root):
            print(f"harness engine setup {e.name}: {eng.python(e, args.root)} is ready ({e.made_by}): nothing to do")
    except eng.EngineError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return 2
    return 0


OWN = "the engine's own (its runner asks the engine)"


def show(args) -> int:
    from harness.registry import broken_entry_points
    from harness.serve import engine as eng

    print(f"{'build':<12} {'engine':<8} {'backends':<9} {'environment':<11} {'python':<36} {'made from':<20} what")
    for e in eng.engines():
        print(f"{e.name:<12} {e.serves:<8} {','.join(sorted(e.backends)):<9} {eng.status(e, args.root):<11} "
              f"{str(eng.python(e, args.root)):<36} {e.made_by:<20} {e.description}; platform {e.platform}"
              f"{'; plugin ' + e.plugin if e.plugin else ''}; variants {', '.join(e.variants) or 'none'}; "
              f"architectures {', '.join(sorted(e.architectures)) or OWN}; from {e.source}")
    for line in broken_entry_points():
        if "harness.engines" in line:
            print(line, file=sys.stderr)
    return 0
