"""Peer benchmarks of pstore: one command for W1-W8.

    python benches/run.py --quick            # a few minutes, smaller tables
    python benches/run.py --full             # the sizes of the issue (10M-row W1, 20M-id W3)
    python benches/run.py --quick --only W1,W3 --json out.json
    python benches/run.py --quick --only W5 --tmp DIR   # DIR: where W5 writes its files
    python benches/run.py --quick --only W6 --source-tree  # a server process, Redis on loopback
    python benches/run.py --quick --only W7 --source-tree  # serving artifacts, model server, ORT
    python benches/run.py --quick --only W8 --source-tree  # DeepFM training: torch vs pstore

Prints one table per workload (median rates, ratios against peers measured side by side in the
same run) and writes every sample as JSON (default bench-results/results-<timestamp>.json).
Nothing is asserted: the machine may be shared and noisy; read the medians and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from harness import (
    REPO_ROOT,
    Row,
    environment,
    fmt_ids,
    format_rows,
    format_table,
    import_pstore,
    import_pyarrow,
    import_torch,
    log,
)
from serving import format_w7, w7_serving
from torch_ctr import W8_AUC_TOL, format_w8, w8_torch_ctr
from workloads import FULL, QUICK, WORKLOADS, Context, Section

ALL_WORKLOADS = {**WORKLOADS, "W7": w7_serving, "W8": w8_torch_ctr}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes (the default)")
    mode.add_argument("--full", action="store_true", help="the full sizes of the issue")
    p.add_argument("--only", default="", help="comma-separated workloads, e.g. W1,W3")
    p.add_argument("--reps", type=int, default=None, help="repetitions (quick 5, full 7)")
    p.add_argument(
        "--source-tree",
        action="store_true",
        help="benchmark the repo's pstore/ (built in place) even if pstore is installed",
    )
    p.add_argument("--json", type=Path, default=None, help="where to write the results")
    p.add_argument(
        "--tmp",
        type=Path,
        default=None,
        help="directory in which W5 and W7 create their temporary directories of stores,\n"
        "snapshots and artifacts (default: the repository's bench-results/; deleted at the end)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch.set_num_threads value (default: torch's own default, set explicitly)",
    )
    return p.parse_args(argv)


def _print_section(sec: Section) -> None:
    print(f"\n== {sec.workload}: {sec.title}")
    shown = {k: v for k, v in sec.config.items() if not isinstance(v, dict)}
    print("   " + ", ".join(f"{k}={_short(v)}" for k, v in shown.items()))
    if sec.workload == "W3":
        print(_format_w3(sec))
    elif sec.workload == "W5":
        print(_format_w5(sec))
    elif sec.workload == "W6":
        print(_format_w6(sec))
    elif sec.workload == "W7":
        print(format_w7(sec))
    elif sec.workload == "W8":
        print(format_w8(sec))
    else:
        print(format_rows(sec.rows))
    for note in sec.notes:
        print(f"   NOTE: {note}")
    sys.stdout.flush()


def _short(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _format_w3(sec: Section) -> str:
    headers = ["impl", "M ins/s median", "M ins/s min-max", "ratio", "ratio of"]
    headers += ["B/key RSS", "B/key stats", "RSS/raw", "target", "met", "batch p50 ms", "max ms"]
    lines = []
    for r in sec.rows:
        e = r.extra
        met = e.get("bytes_target_met")
        lines.append(
            [
                r.impl,
                f"{r.median / 1e6:.2f}",
                f"{min(r.samples) / 1e6:.2f}-{max(r.samples) / 1e6:.2f}",
                "" if r.ratio is None else f"{r.ratio:.2f}x",
                r.ratio_of,
                f"{e['rss_bytes_per_key']:.1f}",
                f"{e['stats_bytes_per_key']:.1f}" if "stats_bytes_per_key" in e else "-",
                f"{e['rss_over_raw']:.2f}x",
                "<=1.4x" if met is not None else "",
                {None: "", True: "yes", False: "NO"}[met],
                f"{e['batch_p50_ms']:.1f}",
                f"{e['batch_max_ms']:.1f}",
            ]
        )
    return format_table(headers, lines)


def _fmt_ratio(r: Row) -> str:
    if r.ratio is None:
        return ""
    if r.extra.get("ratio_fmt") == "pct":
        return f"{100 * r.ratio:.3g}%"
    return f"{r.ratio:.2f}x"


def _format_w5(sec: Section) -> str:
    """W5's parts, one table each: seconds (median, min-max), a rate, the ratio and details."""
    headers = ["case", "dist", "impl", "s median", "s min-max", "rate", "ratio", "ratio of"]
    headers += ["target", "met", "detail"]
    out = []
    for part, title in sec.config.get("parts", {}).items():
        rows = [r for r in sec.rows if r.extra.get("part") == part]
        if not rows:
            continue
        lines = []
        for r in rows:
            secs = r.extra.get("seconds")
            if r.status != "ok":
                lines.append([r.case, r.dist, r.impl, "-", "-", "", "", "", r.target, r.status, ""])
                continue
            lines.append(
                [
                    r.case,
                    r.dist,
                    r.impl,
                    f"{statistics.median(secs):.3g}" if secs else "",
                    f"{min(secs):.3g}-{max(secs):.3g}" if secs and len(secs) > 1 else "",
                    r.extra.get("rate", ""),
                    _fmt_ratio(r),
                    r.ratio_of,
                    r.target,
                    {None: "", True: "yes", False: "NO"}[r.met],
                    r.extra.get("detail", ""),
                ]
            )
        out.append(f"-- {part}: {title}\n" + format_table(headers, lines))
    return "\n".join(out) if out else "   (no rows)"


def _fmt_ms(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _fmt_small_ratio(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _format_w6(sec: Section) -> str:
    """W6: aggregate ids/s (median, min-max of the repetitions), ratio, target, and the per-call
    latency percentiles over all the timed calls of the repetitions."""
    headers = ["case", "batch", "impl", "ids/s median", "ids/s min-max", "ratio", "ratio of"]
    headers += ["target", "met", "p50 ms", "p99 ms", "calls"]
    lines = []
    for r in sec.rows:
        if r.status != "ok":
            lines.append([r.case, str(r.batch), r.impl, "-", "-", "", "", r.target, r.status])
            lines[-1] += ["", "", ""]
            continue
        e = r.extra
        lines.append(
            [
                r.case,
                str(r.batch),
                r.impl,
                fmt_ids(statistics.median(r.samples)),
                f"{fmt_ids(min(r.samples))}-{fmt_ids(max(r.samples))}",
                _fmt_small_ratio(r.ratio),
                r.ratio_of,
                r.target,
                {None: "", True: "yes", False: "NO"}[r.met],
                _fmt_ms(e["p50_ms"]),
                _fmt_ms(e["p99_ms"]),
                str(e["calls"]),
            ]
        )
    return format_table(headers, lines) if lines else "   (no rows)"


def _print_targets(sections: list[Section]) -> None:
    lines = []
    for sec in sections:
        for r in sec.rows:
            if sec.workload == "W8" and "auc_met" in r.extra:
                diff, ok = f"{r.extra['auc_diff']:+.4f}", r.extra["auc_met"]
                what = f"{r.impl} - torch"
                lines.append(["W8", "test AUC", r.dist, str(r.batch), what, diff,
                              f"|d|<={W8_AUC_TOL}", "yes" if ok else "NO"])  # fmt: skip
            if sec.workload == "W3" and "bytes_target_met" in r.extra:
                met = r.extra["bytes_target_met"]
                ratio, target = r.extra["rss_over_raw"], "<=1.4x"
                what = f"{r.impl} RSS B/key / 128"
            elif r.target and r.status == "ok" and r.ratio is not None:
                met, ratio, what, target = r.met, r.ratio, r.ratio_of, r.target
            else:
                continue
            lines.append(
                [
                    sec.workload,
                    r.case,
                    r.dist,
                    str(r.batch or "-"),
                    what,
                    _fmt_ratio(r) if sec.workload == "W5" else f"{ratio:.2f}x",
                    target,
                    "yes" if met else "NO",
                ]
            )
    if lines:
        headers = ["workload", "case", "dist", "batch", "ratio of", "ratio", "target", "met"]
        print("\n== targets (medians of this run; informational, nothing is asserted)")
        print(format_table(headers, lines))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    sizes = FULL if args.full else QUICK
    if args.reps is not None:
        sizes = replace(sizes, reps=args.reps)
    only = [w.strip().upper() for w in args.only.split(",") if w.strip()] or list(ALL_WORKLOADS)
    unknown = [w for w in only if w not in ALL_WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(ALL_WORKLOADS)}")

    pstore = import_pstore(source_tree=args.source_tree)
    torch = import_torch()
    pyarrow = import_pyarrow()
    if torch is not None:
        torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    env = environment(pstore, torch)
    env["pyarrow"] = pyarrow.__version__ if pyarrow is not None else None
    started = time.strftime("%Y%m%d-%H%M%S")
    json_path = args.json or REPO_ROOT / "bench-results" / f"results-{started}.json"

    print(f"pstore peer benchmarks, mode={sizes.mode}, reps={sizes.reps}, workloads={only}")
    print(
        f"machine: {env['cpu_count']} cores ({env['cpus_usable']} usable), {env['cpu_model']}, "
        f"{env['mem_total_gib']} GiB, loadavg {env['loadavg_start']}"
    )
    print(
        f"python {env['python']}, numpy {env['numpy']}, torch {env['torch'] or 'not installed'}, "
        f"pyarrow {env['pyarrow'] or 'not installed'}, "
        f"pstore {env['pstore']} ({env['pstore_path']})"
    )
    for where, info in env["pstore_native"].items():
        print(f"native module ({where}): {info['path']}, {info['bytes']:,} bytes, {info['mtime']}")
    torch_threads = env["torch_threads"] if torch is not None else "n/a"
    print(
        f"threads: torch.set_num_threads({torch_threads}); numpy take/add.at are single-threaded "
        f"(no BLAS involved); pstore Store() default pool, Store(threads=1) where stated"
    )
    for k, v in env["env"].items():
        print(f"env: {k}={v}")
    print(
        "ids: Zipf(1.05) ranks through a random permutation of the rows, and uniform; pstore and "
        "the dict peer see scattered 64-bit ids, numpy/torch see row positions"
    )
    print(
        "rates: median of the repetitions (interleaved with the peers), in millions per second; "
        "ratio = reference median / this row's median"
    )
    sys.stdout.flush()

    ctx = Context(
        pstore=pstore,
        torch=torch,
        sizes=sizes,
        reps=sizes.reps,
        pyarrow=pyarrow,
        tmp_parent=args.tmp,
    )
    sections: list[Section] = []
    for name in only:
        t0 = time.perf_counter()
        sec = ALL_WORKLOADS[name](ctx)
        sec.config["wall_s"] = round(time.perf_counter() - t0, 1)
        sections.append(sec)
        _print_section(sec)

    _print_targets(sections)
    env["loadavg_end"] = os.getloadavg()
    print(f"\nloadavg at end: {env['loadavg_end']}")
    doc = {
        "started": started,
        "argv": sys.argv[1:],
        "sizes": asdict(sizes),
        "environment": env,
        "workloads": {
            s.workload: {
                "title": s.title,
                "config": s.config,
                "notes": s.notes,
                "rows": [r.to_json() for r in s.rows],
            }
            for s in sections
        },
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"results written to {json_path}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
