"""The ``flip_cost`` event's detail: what one applied switch flip cost the live session (the wire contract's
one declaration of it, importable with no dependency: the worker writes it, worker/readiness.py ``FlipCost``;
analytics/flips.py and api/incidents.py read it from the ``events`` table).

A worker sends one ``flip_cost`` event per flip of a session, at the session's end, beside the
``switch_applied`` event of the step it took effect."""

FLIP_COST_KIND = "flip_cost"
# how a worker applies a flip (``livestep worker run --flip``; worker/readiness.py): built on a thread and
# swapped in at a step boundary, or rebuilt in the step loop (the plain path)
FLIP_MODES: tuple[str, ...] = ("background", "inline")

# field -> meaning (times in ms; null where it does not apply)
FLIP_COST_FIELDS: dict[str, str] = {
    "step": "the step whose poll brought the flip (-1: the session started on switches the worker was not warm for)",
    "applied_step": "the first step on the new configuration (null: still building when the session ended)",
    "changed": "the switches the flip changed, name -> new value",
    "switches": "the switch state it flipped to",
    "mode": "background (built on a thread, swapped at a step boundary), session_start, or inline (rebuilt in "
            "the step loop: the plain path, tensor parallel, or a failed build)",
    "late_chunks": "chunks late from the poll to steps_observed chunks after the first step on the new configuration",
    "stall_ms": "the player's stall over the same chunks",
    "steps_observed": "chunks after the swap that the late chunks and stall cover (at most the worker's window)",
    "to_new_config_ms": "the poll to the first step on the new configuration",
    "apply_ms": "the swap's own time at the step boundary (inline: the whole rebuild in the loop)",
    "build_ms": "the background build's time (the target's warm state)",
    "out_of_service_ms": "the worker blocked after the session before it could serve the next one (a re-warm)",
    "error": "why the background build failed (the flip then applied inline), else null",
}
