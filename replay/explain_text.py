"""What ``replay explain`` prints: a request's story (``replay.explain``'s
``ExplainObserver.to_json``) and a token step (``replay.step``'s
``StepObserver.to_json``), from their JSON data, so ``--json`` and the text
show the same facts.
"""

from __future__ import annotations

from typing import Any

from replay.brief import blocks_text, ranges_text
from replay.text import field

__all__ = ["format_step", "format_story"]


def format_story(data: dict[str, Any], verbose: bool = False) -> str:
    if not data["found"]:
        return f"request {field(data['req_id'])} does not appear in the log"
    lines = [f"request {field(data['req_id'])}:"]
    for line in data["story"]:
        lines.append(f"  seq {line['seq']:>8}  step {line['step']:>6}  {line['text']}")
        lines += [f"{'':28}{text}" for text in line.get("chain", ())]
    lines.append("store ops:")
    for op in data["ops"]:
        gen = f" gen {op['generation']}" if op["generation"] else ""
        outcome = op["status"].upper()
        if op["cause"]:
            outcome += f" ({op['cause']}"
            if op["block_id"] >= 0:
                outcome += f", block {op['block_id']}"
            if op["reused_by"]:
                outcome += f" reused by {op['reused_by']}"
            outcome += ")"
        risk = (f", at risk at {len(op['at_risk'])} step(s) "
                f"{ranges_text([r['step'] for r in op['at_risk']], verbose)}"
                if op["at_risk"] else "")
        if op["trimmed_tokens"]:
            gen += f" (its first {op['trimmed_tokens']} tokens trimmed: duplicate)"
        lines.append(f"  [{op['start_token']}, {op['end_token']}){gen}: buffered at step "
                     f"{op['buffered_step']} on {blocks_text(op['block_ids'], verbose)}{risk} "
                     f"-> {outcome}")
    return "\n".join(lines)


def format_step(data: dict[str, Any]) -> str:
    if not data["found"]:
        return f"token step {data['step']} is not in the log"
    if data.get("passed") and not data["events"]:
        seq, first, last = data["passed"]
        return (f"token step {data['step']} passed quietly: seq {seq} reported steps {first} "
                f"to {last} together (StepsPassed), none of them moving anything the core "
                "watches (no buffered block in the window, no watched block reallocated)")
    lines = [f"token step {data['step']}:"]
    for item in data["events"]:
        lines.append(f"  seq {item['seq']:>8}  {item['event']}")
        lines += [f"{'':16}decided {text}" for text in item["decisions"]]
        lines += [f"{'':16}commanded {text}" for text in item["commands"]]
    after = data["state_after"]
    lines.append("after it: " + ", ".join(f"{key.replace('_', ' ')} {value}"
                                          for key, value in after.items()))
    return "\n".join(lines)
