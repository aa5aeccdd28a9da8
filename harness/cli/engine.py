"""`harness engine setup|show`: the serving engines' own environments (docs/serving.md)."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("engine", help="serving engines: set up their environments, list them")
    es = p.add_subparsers(dest="engine_command", metavar="ACTION")
    s = es.add_parser("setup", help="create the engine's venv under .harness/engines/NAME from its pins "
                      "(a no-op when it is there and made from the same pins)")
    s.add_argument("name", help="engine name (harness engine show lists them)")
    s.add_argument("--root", default=None, help="where engine environments live (default: .harness/engines)")
    s.set_defaults(func=setup)
    sh = es.add_parser("show", help="list the engines and whether their environment exists")
    sh.add_argument("--root", default=None, help="where engine environments live (default: .harness/engines)")
    sh.set_defaults(func=show)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def setup(args) -> int:
    from harness.serve import engine as eng

    try:
        e = eng.get(args.name)
        if not eng.setup(e, args.root):
            print(f"harness engine setup {e.name}: {eng.env_dir(e, args.root)} is ready (pins {e.pins}): nothing to do")
    except eng.EngineError as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return 2
    return 0


def show(args) -> int:
    from harness.serve import engine as eng

    print(f"{'engine':<8} {'environment':<8} {'path':<28} {'pins':<14} what")
    for e in eng.ENGINES.values():
        print(f"{e.name:<8} {eng.status(e, args.root):<8} {str(eng.env_dir(e, args.root)):<28} {e.pins:<14} "
              f"{e.description}; backends {', '.join(sorted(e.backends))}; "
              f"architectures {', '.join(sorted(e.architectures))}")
    return 0
