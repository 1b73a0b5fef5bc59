"""Compact table of an `ncu --csv --metrics ...` run (tools/device/profile_decode.py): one line
per kernel launch with its duration, the DRAM bytes it read, the bandwidth that makes, and the
other metrics asked for (percentages).

    python3 tools/device/ncu_summary.py run.csv
"""
import csv
import sys
from collections import OrderedDict

TIME_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
BYTES = {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}


def main() -> None:
    rows: OrderedDict[str, dict[str, tuple[float, str]]] = OrderedDict()
    names: dict[str, str] = {}
    with open(sys.argv[1], newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # drop the profiler's own messages
    for rec in csv.DictReader(lines):
        names[rec["ID"]] = rec["Kernel Name"]
        try:
            value = float(rec["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        rows.setdefault(rec["ID"], {})[rec["Metric Name"]] = (value, rec["Metric Unit"])
    extra = sorted({m for r in rows.values() for m in r} - {"gpu__time_duration.sum", "dram__bytes_read.sum"})
    print(f"{'id':>4} {'kernel':<44} {'us':>8} {'MB':>8} {'GB/s':>6} " + " ".join(m.split("__")[1][:18] for m in extra))
    total_t = total_b = 0.0
    for key, r in rows.items():
        t, tu = r.get("gpu__time_duration.sum", (float("nan"), "ns"))
        t_us = t * TIME_US.get(tu, float("nan"))
        b, bu = r.get("dram__bytes_read.sum", (float("nan"), "byte"))
        b *= BYTES.get(bu, float("nan"))
        name = names[key].split("(")[0].replace("void ", "").replace("(anonymous namespace)::", "")[-44:]
        more = " ".join(f"{r[m][0]:18.1f}" if m in r else f"{'-':>18}" for m in extra)
        print(f"{key:>4} {name:<44} {t_us:8.1f} {b / 1e6:8.2f} {b / t_us / 1e3 if t_us else 0:6.0f} {more}")
        total_t += t_us
        total_b += b
    if total_t:
        print(f"total {total_t:.1f} us, {total_b / 1e6:.1f} MB, {total_b / total_t / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
