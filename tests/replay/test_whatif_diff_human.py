"""``whatif`` and ``diff`` for humans: a knob the chosen policy does not read
(or only the connector reads) is refused; ``--out`` says where it wrote,
names the two logs apart and never overwrites one; ``diff`` of a log and its
what-if shows the first differing decision, and the input before it, in a
few short lines."""

from __future__ import annotations

from pathlib import Path

import attrs

from offload_fsm.vocabulary.config import OffloadConfig, Policy
from replay import whatif
from tests.replay.conftest import run_cli

GOLDEN = Path(__file__).parent.parent / "data" / "logs" / "v6"


def test_a_knob_the_policy_does_not_read_is_refused() -> None:
    code, out, err = run_cli("whatif", str(GOLDEN), "--set", "threshold=2")
    assert code == 2 and out == ""
    assert ("--set threshold: EVICTION_AWARE does not read it (a FIFO knob; EVICTION_AWARE "
            "reads horizon_steps") in err and "add --policy FIFO" in err
    code, _, err = run_cli("whatif", str(GOLDEN), "--policy", "FIFO", "--set", "horizon_steps=5")
    assert code == 2 and "FIFO does not read it (a EVICTION_AWARE knob" in err
    code, _, err = run_cli("whatif", str(GOLDEN), "--set", "log_dir=/tmp")
    assert code == 2 and "the connector reads it, not the core" in err
    code, out, _ = run_cli("whatif", str(GOLDEN), "--policy", "FIFO", "--set", "threshold=2")
    assert code == 0 and "what-if FIFO" in out


def test_the_policy_knobs_table_says_what_each_policy_reads(mixed_log: Path) -> None:
    """Changing a knob of one policy leaves a what-if under the other one
    unchanged (so refusing it loses nothing)."""
    header, events, _ = whatif.load_observations(mixed_log)
    changed = {"threshold": 2, "select_count": 3, "horizon_steps": 9.0,
               "max_drain_per_step": 1, "chunk_split": False, "cascade_lookahead_blocks": 0}
    for policy, knobs in whatif.POLICY_KNOBS.items():
        other = next(p for p in Policy if p is not policy)
        base = OffloadConfig(policy=other)
        expected = whatif.simulate(base, header.world_size, events)
        for knob in knobs:
            got = whatif.simulate(attrs.evolve(base, **{knob: changed[knob]}),
                                  header.world_size, events)
            assert got == expected, (policy, knob)
        assert any(whatif.simulate(attrs.evolve(OffloadConfig(policy=policy),
                                                **{knob: changed[knob]}),
                                   header.world_size, events)
                   != whatif.simulate(OffloadConfig(policy=policy), header.world_size, events)
                   for knob in knobs), policy


def test_out_says_where_it_wrote_names_apart_and_never_overwrites(tmp_path: Path) -> None:
    out_dir = tmp_path / "wi"
    code, out, err = run_cli("whatif", str(GOLDEN), "--policy", "FIFO", "--out", str(out_dir))
    assert code == 0, err
    assert (f"wrote the re-simulated original to {out_dir}/original and the what-if to "
            f"{out_dir}/whatif; compare them: replay diff {out_dir}/original "
            f"{out_dir}/whatif") in out
    assert [p.name for p in (out_dir / "original").iterdir()] == ["original-000000.lolog"]
    assert [p.name for p in (out_dir / "whatif").iterdir()] == ["whatif-000000.lolog"]
    code, _, err = run_cli("whatif", str(GOLDEN), "--policy", "FIFO", "--out", str(out_dir))
    assert code == 2 and "original-000000.lolog exists; pick another directory" in err

    code, out, _ = run_cli("diff", str(out_dir / "original"), str(out_dir / "whatif"),
                        "--no-ledgers")
    lines = out.splitlines()
    assert code == 1
    assert lines[0] == ("DIVERGED at seq 2 (input): the logs record different inputs "
                        "(fields: window_block_ids, reallocated)")
    assert "window_block_ids=128 [52-179], reallocated=48 items" in out  # not 128 ids
    at = lines.index("first differing DECISION: observation 774 (A seq 774, B seq 774), "
                     "which each log recorded as")
    assert lines[at + 2].startswith("    decided: OpsSelected(req_id='s52t0', batch_id=0")
    assert lines[at + 4] == "    decided: nothing"
    assert len(lines) <= 13 and max(map(len, lines)) < 1000
