"""The server run and checks the live-server tests share (test_live_server*.py)."""

from __future__ import annotations

from scripts.rigs.server import (
    LiveServer,
    agreeing_prefix,
    output_logprobs,
    run_sequence,
    to_stderr,
)


def serve(flags, name, model, prompts, *, env=None, via="launch_server", **seq):
    """run_sequence on a fresh server (keyword args go to it), replies saved
    beside its log; the sequence plus the log and the stand-in's events."""
    server = LiveServer(
        flags, name=name, via=via, model=model, env=env, progress=to_stderr
    )
    with server:
        out = run_sequence(server, prompts, **seq)
        out["log"], out["kernel_calls"] = server.log_text(), server.kernel_calls()
    server.save_replies(out)
    return out


def assert_greedy_close(ref: dict, other: dict, min_agreed: int, tol: float):
    """Greedy tokens agree up to a near-tie, for at least min_agreed tokens,
    and the agreed tokens' logprobs move by at most tol: (agreed, worst)."""
    agreed = agreeing_prefix(ref, other)
    assert agreed >= min_agreed, (agreed, ref["output_ids"], other["output_ids"])
    pairs = zip(output_logprobs(ref)[:agreed], output_logprobs(other))
    worst = max(abs(a - b) for a, b in pairs)
    assert worst <= tol, (worst, output_logprobs(ref), output_logprobs(other))
    return agreed, worst


def called_ops(kernel_calls: list[dict]) -> set[str]:
    """The sgl_kernel stand-in ops a server called (loads are not calls)."""
    return {e["op"] for e in kernel_calls if e["event"] == "call"}
