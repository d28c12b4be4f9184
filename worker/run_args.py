"""What ``livestep worker run``'s options make of a worker, shared by the one-process CLI (worker/cli.py) and
each tensor-parallel rank (worker/parallel.py ``run_cli``), so that neither imports the other.

    warm_up(worker, switches, args)          # --no-warm, --flip: the warm-up (and the flip neighbours)
    client_kwargs(args)                      # --telemetry-file: the shipping client's options
    turns_of(args, worker)                   # --turns-every: a conversation for one session, or None
"""

from __future__ import annotations


def warm_up(w, switches, args, say: bool = True) -> None:
    """``Worker.warm`` for the initial switches unless ``--no-warm`` (worker/session.py says what it does)."""
    if args.no_warm:
        return
    from worker.readiness import RUNTIME_SWITCHES

    # a background flip needs its neighbour's compiles done (worker/readiness.py); under tensor parallel
    # flips apply inline on every rank at one step
    neighbours = RUNTIME_SWITCHES if w.readiness.mode == "background" and getattr(w, "tp", None) is None else ()
    warm = w.warm(switches, neighbours=neighbours)
    if say:
        print(f"warm: {warm.runner.n_graphs} CUDA graphs for prompt buckets {list(warm.buckets)} in "
              f"{warm.seconds:.1f} s" + (f"; {len(w.readiness.prepared)} flip neighbours prepared" if neighbours
                                         else ""), flush=True)


def client_kwargs(args) -> dict | None:
    """The session's shipping client's options from the command line (``--telemetry-file``)."""
    return {"telemetry_file": args.telemetry_file} if args.telemetry_file else None


def turns_of(args, w):
    """A conversation for one session (``--turns-every``), or None."""
    if not args.turns_every:
        return None
    import random

    from worker.turns import TurnSchedule, conversation

    try:
        lo, hi = (float(x) for x in args.turns_every.split(","))
    except ValueError:
        raise SystemExit(f"--turns-every {args.turns_every!r}: write LO,HI seconds, e.g. 2,5") from None
    seconds = args.seconds if args.steps is None else args.steps / 6
    return TurnSchedule(conversation(seconds, random.Random(), (lo, hi), w.shape.cond_tokens))


