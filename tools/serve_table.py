"""The table of docs/serving.md, rendered from `sparq-cpp bench serve -o` JSON files:

    python -m tools.serve_table docs/bench-serve-smollm2-4k.json ...

A row per depth, number of users and mode: decode tokens/s of all users together (over all the decoding time, and
while no prompt waited), time to first token, inter-token latency (all gaps, and the gaps while no prompt waited),
how many replies each user got again alone, peak RSS and the caches one user holds. A row measured again in a later
file replaces the earlier one (the page says why)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from sparq_cpp.bench.e2e_config import fmt_depth
from sparq_cpp import doctable
from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import fmt_bytes

HEAD = ["model", "S", "users", "mode", "decode tok/s", "with no prompt waiting", "TTFT p50 / p95",
        "ITL p50 / p99", "ITL p50 / p99, no prompt waiting", "same text alone", "peak RSS", "caches per user"]


def _n(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(d: dict) -> str:
    return "-" if not d else f"{1e3 * d['p50']:,.0f} / {1e3 * d['p99']:,.0f} ms"


def _s(d: dict) -> str:
    return "-" if not d else f"{d['p50']:.1f} / {d['p95']:.1f} s"


def rows(doc: dict, where: str) -> list:
    if doc.get("schema") != "sparq-cpp-bench-serve/1":
        raise SparqError(f"{where} is not a `sparq-cpp bench serve` JSON (schema {doc.get('schema')!r})")
    model = Path(doc["model"]["path"]).stem
    out = []
    for r in doc["results"]:
        alone = r.get("same_as_alone")
        out.append([model, fmt_depth(r["depth"]), str(r["users"]), r["mode"], _n(r["decode_tokens_per_s"]),
                    _n(r["decode_only_tokens_per_s"]), _s(r["ttft_s"]), _ms(r["itl_s"]),
                    _ms(r.get("itl_decode_only_s") or {}),
                    "-" if not alone else f"{alone['identical']} of {alone['compared']}",
                    fmt_bytes(r["peak_rss_bytes"] or 0), fmt_bytes(r["kv_bytes_per_user"])])
    return out


def markdown(paths) -> str:
    """The rows of every file, in the order given; a row of a later file measured again (the same model, depth,
    users and mode) replaces the earlier one in its place."""
    table = {}
    for path in paths:
        for row in rows(json.loads(Path(path).read_text(encoding="utf-8")), str(path)):
            table[tuple(row[:4])] = row
    return doctable.markdown_table(HEAD, list(table.values()))


def main(argv=None) -> int:
    return doctable.main(sys.argv[1:] if argv is None else argv, markdown,
                         "python -m tools.serve_table SERVE.json [...]")


if __name__ == "__main__":
    sys.exit(main())
