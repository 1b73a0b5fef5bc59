"""tools/device/trace_decode.py --plot pairs the launch kinds of traces side by side: two builds
whose persistent grids differ (another CTA count per launch) must still compare each launch with
the same launch, not with nothing."""
from __future__ import annotations

from helpers.tools import load_tool


def table(*kinds: str) -> dict:
    return {"kinds": [{"kind": k} for k in kinds]}


def test_kinds_pair_by_name_and_rank_whatever_their_grids() -> None:
    td = load_tool("device/trace_decode.py")
    a = table("direct K=4096 out#0 grid=264x1", "attn_decode K=0 out#1 grid=8x1", "direct K=4096 out#0 grid=384x1",
              "direct K=12288 out#2 grid=256x1")
    b = table("direct K=4096 out#0 grid=248x1", "attn_decode K=0 out#1 grid=8x1", "direct K=4096 out#0 grid=368x1",
              "direct K=12288 out#2 grid=256x1", "direct K=4096 out#3 grid=368x1")
    order, labels = td.slots([a, b])
    assert order == [("direct K=4096 out#0", 0), ("attn_decode K=0 out#1", 0), ("direct K=4096 out#0", 1),
                     ("direct K=12288 out#2", 0), ("direct K=4096 out#3", 0)]
    # the first and the second QKV kind of each table pair up, in the order they appear
    assert [k["slot"] for k in a["kinds"]] == order[:4]
    assert [k["slot"] for k in b["kinds"]] == order
    assert labels[("direct K=4096 out#0", 0)] == "direct K=4096 out#0\n264x1 / 248x1"
    assert labels[("direct K=4096 out#0", 1)] == "direct K=4096 out#0\n384x1 / 368x1"
    assert labels[("attn_decode K=0 out#1", 0)] == "attn_decode K=0 out#1\n8x1"  # one grid: named once
    assert labels[("direct K=4096 out#3", 0)] == "direct K=4096 out#3\n368x1"  # only in b
