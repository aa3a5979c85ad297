"""`auto`: the sparse setting with the best measured fidelity within a compression budget.

`sparq-cpp calibrate` measures on the user's text the error of the attention output each candidate computes
(and the attention mass it keeps), per full-attention layer (calib.budget: SparQ and Loki, each with the rank at 1/2, 1 and 3/2 of the transfer
formula's split, with and without the first position always kept, at ratios 1/4, 1/8 and 1/16), then runs the
best rank of each method, sink and local window per ratio end to end (calib.probe: bits per character lost against dense on text and
on a repeated paragraph), and stores both in the calibration GGUF as loki.fidelity.* keys (`Fidelity` below).
`Auto(ratio=0.125)`, the spec "auto:ratio=0.125", resolves for a model and a context size, among the candidates
measured at the largest ratio not above the target, to the probed one that loses the fewest bits per character on
text and retrieval together, the text's loss being, where the probe scored several domains (prose, technical
documentation, code, conversation: a setting must hold on text unlike its calibration), that of its worst domain
relative to dense's bits per character there (without a probe: the least mean output error over the layers), its rank scaled by
target / measured ratio, k the largest whose reads fit the target at n_ctx positions
(sparq_cpp.transfer.rank_split), l the measured share of k, sink as measured. One setting for the whole model: a
context has one mode (the cache layout), and choosing the method per layer gained nothing where measured
(docs/accuracy.md). A given calibration, target and n_ctx always give the same setting; its reads at n_ctx are
within the target.

`known_poor` is the warning generate and serve print for a fixed setting the measurement says is the worse
choice on this model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparq_cpp import transfer
from sparq_cpp.attention import Auto, Loki, SparQ
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import metadata_value
from sparq_cpp.projection import default_projection, open_reader, read_projection

# A fixed setting is called poor when the best measured candidate of the other method has this much less
# output error (relative, ||y_sel - y|| / ||y||) at the same ratio, or, probed, loses this many fewer bits per
# character on text and retrieval together.
POOR_MARGIN = 0.05
POOR_PROBE_MARGIN = 0.1


@dataclass(frozen=True)
class Fidelity:
    """calib.budget's measurement as stored: per candidate (method, ratio, rank, k, l and sink at ctx positions),
    the relative error of its attention output and the attention mass it keeps, with the exact top-k's at its k,
    per measured layer; and calib.probe's: for the probed candidates, the bits per character lost against dense
    on text and on a retrieval (probe_dense: dense's own, text and retrieval), and where the text was scored per domain
    (probe_domains), each domain's loss ([candidates, domains]) and dense's bits per character there; probe_text is
    then the worst domain's loss."""

    ctx: int
    windows: int
    held_out: bool
    layers: tuple[int, ...]
    method: tuple[str, ...]
    ratio: tuple[float, ...]
    rank: tuple[int, ...]
    k: tuple[int, ...]
    l: tuple[int, ...]
    mass: np.ndarray  # [candidates, layers]
    exact_mass: np.ndarray
    error: np.ndarray
    exact_error: np.ndarray
    path: Path
    sink: tuple[int, ...] = ()
    probed: tuple[bool, ...] = ()
    probe_text: tuple[float, ...] = ()
    probe_copy: tuple[float, ...] = ()
    probe_dense: tuple[float, ...] = ()
    probe_domains: tuple[str, ...] = ()
    probe_domain_loss: np.ndarray | None = None  # [candidates, domains]
    probe_domain_dense: tuple[float, ...] = ()

    def __post_init__(self):
        n = len(self.method)
        if not self.sink:
            object.__setattr__(self, "sink", (0,) * n)
        if not self.probed:
            for name, value in (("probed", (False,) * n), ("probe_text", (0.0,) * n), ("probe_copy", (0.0,) * n)):
                object.__setattr__(self, name, value)

    @classmethod
    def of(cls, fid: dict, path) -> "Fidelity":
        """From calib.budget's measurement (with calib.probe's under "probe"), as it will be stored."""
        c = fid["candidates"]
        probe = fid.get("probe")
        extra = {} if probe is None else {
            "probed": tuple(bool(x) for x in probe["probed"]), "probe_text": tuple(probe["text"]),
            "probe_copy": tuple(probe["copy"]), "probe_dense": (probe["dense_text"], probe["dense_copy"])}
        if probe is not None and probe.get("domains"):
            extra.update(probe_domains=tuple(probe["domains"]),
                         probe_domain_loss=np.asarray(probe["domain_text"], np.float64).reshape(len(c), -1),
                         probe_domain_dense=tuple(float(x) for x in probe["domain_dense"]))
        return cls(ctx=fid["ctx"], windows=fid["windows"], held_out=bool(fid.get("held_out", False)),
                   layers=tuple(fid["layers"]), method=tuple(x["method"] for x in c),
                   ratio=tuple(float(x["ratio"]) for x in c), rank=tuple(x["rank"] for x in c),
                   k=tuple(x["k"] for x in c), l=tuple(x["l"] for x in c), sink=tuple(x["sink"] for x in c),
                   **{key: np.asarray(fid[key], np.float64) for key in ("mass", "exact_mass", "error", "exact_error")},
                   path=Path(path), **extra)

    def worst_text(self, i: int) -> float:
        """Bits per character lost against dense on text: the worst domain's where the probe scored domains."""
        if self.probe_domains:
            return max(float(x) for x in self.probe_domain_loss[i])
        return self.probe_text[i]

    def worst_domain(self, i: int) -> str:
        """The domain whose text loses most relative to dense's there (the first on a tie); "text" without
        domains."""
        if not self.probe_domains:
            return "text"
        row = [float(x) / dense if dense > 0 else 0.0 for x, dense in zip(self.probe_domain_loss[i],
                                                                          self.probe_domain_dense)]
        return self.probe_domains[row.index(max(row))]

    def domain_losses(self, i: int) -> str:
        """Per domain, the bits per character lost and the loss relative to dense's there."""
        return ", ".join(f"{d} {float(x):+.3f} ({float(x) / dense:+.1%})" if dense > 0 else f"{d} {float(x):+.3f}"
                         for d, x, dense in zip(self.probe_domains, self.probe_domain_loss[i], self.probe_domain_dense))

    def worst_relative(self, i: int) -> float:
        """The largest loss of a probed candidate relative to dense's bits per character, over the domains (or the
        text)."""
        if not self.probe_domains:
            return self.probe_text[i] / self.probe_dense[0] if self.probe_dense[0] > 0 else 0.0
        return max(float(x) / dense if dense > 0 else 0.0
                   for x, dense in zip(self.probe_domain_loss[i], self.probe_domain_dense))

    def probe_loss(self, i: int) -> float:
        """What a probed candidate loses: with domains, the worst domain's loss relative to dense's bits per character
        there, plus the bits per character lost on the retrieval; without (an older calibration), the bits per
        character lost on text and on the retrieval together."""
        if self.probe_domains:
            return self.worst_relative(i) + self.probe_copy[i]
        return self.probe_text[i] + self.probe_copy[i]

    def mean_mass(self, i: int) -> float:
        return float(self.mass[i].mean())

    def mean_error(self, i: int) -> float:
        return float(self.error[i].mean())

    def describe(self, i: int) -> str:
        name = "r" if self.method[i] == "sparq" else "d"
        out = (f"{self.method[i]} {name}={self.rank[i]} k={self.k[i]} l={self.l[i]} sink={self.sink[i]}: output error "
               f"{self.mean_error(i):.3f} (exact top-k {float(self.exact_error[i].mean()):.3f}), keeps "
               f"{self.mean_mass(i):.3f} of the attention")
        if self.probed[i] and self.probe_domains:
            out += (f", loses bits per character on text per domain: {self.domain_losses(i)} (worst "
                    f"{self.worst_domain(i)}), and {self.probe_copy[i]:+.3f} on a retrieval")
        elif self.probed[i]:
            out += (f", loses {self.probe_text[i]:+.3f} bits per character on text and {self.probe_copy[i]:+.3f} on "
                    "a retrieval")
        return out

    def score(self, i: int) -> float:
        """What auto minimises: the probe's loss where probed, else the mean output error."""
        return self.probe_loss(i) if self.probed[i] else self.mean_error(i)


def read_fidelity(path) -> Fidelity | None:
    """The fidelity measurement in a calibration GGUF, or None if it has none (an older calibration)."""
    path = Path(path)
    r = open_reader(path)
    ctx = metadata_value(r, "loki.fidelity.ctx")
    if ctx is None:
        return None
    keys = {key: metadata_value(r, f"loki.fidelity.{key}") for key in
            ("windows", "held_out", "layers", "method", "ratio", "rank", "k", "l", "mass", "exact_mass", "error",
             "exact_error")}
    optional = {key: metadata_value(r, f"loki.fidelity.{key}") for key in
                ("sink", "probed", "probe_text", "probe_copy", "probe_dense", "probe_domains", "probe_domain_loss",
                 "probe_domain_dense")}
    missing = [key for key, v in keys.items() if v is None]
    if missing:
        raise SparqError(f"{path}: loki.fidelity.{missing[0]} is missing; calibrate the model again")
    n = len(keys["method"])
    L = len(keys["layers"])
    for key in ("ratio", "rank", "k", "l"):
        if len(keys[key]) != n:
            raise SparqError(f"{path}: loki.fidelity.{key} has {len(keys[key])} values for {n} candidates")
    arrays = {key: np.asarray(keys[key], np.float64) for key in ("mass", "exact_mass", "error", "exact_error")}
    for key, a in arrays.items():
        if n == 0 or L == 0 or a.size != n * L or not np.isfinite(a).all():
            raise SparqError(f"{path}: loki.fidelity.{key} must hold {n} x {L} finite values; calibrate the model again")
    if any(m not in ("sparq", "loki") for m in keys["method"]):
        raise SparqError(f"{path}: loki.fidelity.method holds an unknown method: {sorted(set(keys['method']))}")
    extra = {}
    if optional["sink"] is not None:
        if len(optional["sink"]) != n or any(int(x) < 0 for x in optional["sink"]):
            raise SparqError(f"{path}: loki.fidelity.sink must hold {n} values >= 0; calibrate the model again")
        extra["sink"] = tuple(int(x) for x in optional["sink"])
    if optional["probed"] is not None:
        probe = [optional[key] for key in ("probed", "probe_text", "probe_copy", "probe_dense")]
        if any(v is None for v in probe) or any(len(v) != n for v in probe[:3]) or len(probe[3]) != 2 \
                or not all(np.isfinite(np.asarray(v, np.float64)).all() for v in probe[1:]):
            raise SparqError(f"{path}: loki.fidelity.probe_* must hold {n} finite values each (probe_dense 2); "
                             "calibrate the model again")
        extra.update(probed=tuple(bool(x) for x in probe[0]), probe_text=tuple(float(x) for x in probe[1]),
                     probe_copy=tuple(float(x) for x in probe[2]), probe_dense=tuple(float(x) for x in probe[3]))
        extra.update(_read_domains(path, optional, n))
    return Fidelity(ctx=int(ctx), windows=int(keys["windows"]), held_out=bool(keys["held_out"]),
                    layers=tuple(int(x) for x in keys["layers"]), method=tuple(keys["method"]),
                    ratio=tuple(float(x) for x in keys["ratio"]), rank=tuple(int(x) for x in keys["rank"]),
                    k=tuple(int(x) for x in keys["k"]), l=tuple(int(x) for x in keys["l"]),
                    **{key: a.reshape(n, L) for key, a in arrays.items()}, path=path, **extra)


def _read_domains(path: Path, keys: dict, n: int) -> dict:
    """The probe's per-domain losses (loki.fidelity.probe_domain*), checked; {} where the file has none."""
    names, loss, dense = keys["probe_domains"], keys["probe_domain_loss"], keys["probe_domain_dense"]
    if names is None and loss is None and dense is None:
        return {}
    m = len(names) if isinstance(names, list) else 0
    if m == 0 or not all(isinstance(x, str) and x for x in names) or len(set(names)) != m:
        raise SparqError(f"{path}: loki.fidelity.probe_domains must name one or more distinct domains; calibrate "
                         "the model again")
    for key, value, count in (("probe_domain_loss", loss, n * m), ("probe_domain_dense", dense, m)):
        if not isinstance(value, list) or len(value) != count or not np.isfinite(np.asarray(value, np.float64)).all():
            raise SparqError(f"{path}: loki.fidelity.{key} must hold {count} finite values ({m} domains); calibrate "
                             "the model again")
    return {"probe_domains": tuple(names), "probe_domain_loss": np.asarray(loss, np.float64).reshape(n, m),
            "probe_domain_dense": tuple(float(x) for x in dense)}


def _measured_ratio(fid: Fidelity, target: float) -> float:
    """The largest measured ratio not above target (float32 storage: compared with a little slack), else the
    smallest measured one."""
    measured = sorted(set(fid.ratio))
    below = [x for x in measured if x <= target * (1 + 1e-6)]
    return below[-1] if below else measured[0]


def choose(fid: Fidelity, target: float, method: str | None = None) -> int:
    """The index of the candidate at the measured ratio for target (of `method` only, if given) that the probe
    measured losing the fewest bits per character on text and retrieval together, or, where none of them was
    probed, with the smallest mean output error; the first such candidate on a tie."""
    base = _measured_ratio(fid, target)
    idx = [i for i in range(len(fid.method)) if fid.ratio[i] == base and method in (None, fid.method[i])]
    if not idx:
        raise SparqError(f"{fid.path}: no {method or 'sparse'} setting was measured at ratio {base:.4g}")
    probed = [i for i in idx if fid.probed[i]]
    return min(probed or idx, key=lambda i: (fid.score(i), i))


def calibration_for(model_path, projection=None) -> Path:
    """The calibration GGUF `auto` reads: `projection`, else <model stem>.loki.gguf next to the model."""
    path = Path(projection) if projection is not None else default_projection(Path(model_path))
    if not path.is_file():
        raise SparqError(f"--attn auto chooses from a calibration of the model, and {path} does not exist: run "
                         f"`sparq-cpp calibrate -m {model_path} --text FILE` (it writes {path}), or give the file "
                         "(auto:proj=FILE, --loki-pca FILE)")
    return path


def resolve(auto: Auto, model_path, summary, n_ctx: int) -> tuple[SparQ | Loki, str]:
    """The setting `auto` stands for on this model at n_ctx positions, and a line saying why."""
    path = calibration_for(model_path, auto.projection)
    read_projection(path, model_path=model_path)  # made for this model, or an error naming the difference
    fid = read_fidelity(path)
    if fid is None:
        raise SparqError(f"{path} has no fidelity measurement (calibrated by an older sparq-cpp); calibrate the "
                         "model again for --attn auto")
    D = summary.head_dim
    i = choose(fid, auto.ratio)
    base = fid.ratio[i]
    if auto.max_loss is not None:
        _check_bound(fid, auto, i, path)
    rank = max(1, min(D, round(fid.rank[i] * auto.ratio / base)))
    got = transfer.rank_split(fid.method[i], auto.ratio, n_ctx, D, rank)
    if got is None:
        raise SparqError(f"auto:ratio={auto.ratio:g}: no {fid.method[i]} setting reads that little at a context of "
                         f"{n_ctx} positions; raise the ratio or the context size")
    rank, k = got
    l = int(k * fid.l[i] / fid.k[i])  # the measured share of k
    sink = min(fid.sink[i], k - l)
    if fid.method[i] == "sparq":
        # the paper's choice: mean-value reallocation off for GQA models
        chosen = SparQ(r=rank, k=k, l=l, mean_value=summary.n_head == summary.n_head_kv, sink=sink)
    else:
        chosen = Loki(d=rank, k=k, l=l, projection=str(path), sink=sink)
    rival = [j for j in range(len(fid.method)) if fid.ratio[j] == base and fid.method[j] != fid.method[i]]
    other = f"; best {fid.method[rival[0]]}: {fid.score(choose(fid, auto.ratio, fid.method[rival[0]])):.3f}" \
        if rival else ""
    why = (f"auto:ratio={auto.ratio:g} -> {chosen.name} ({'r' if chosen.name == 'sparq' else 'd'}={rank}, k={k}, l={l}, "
           f"sink={sink} at n_ctx={n_ctx}): at {fid.ctx} positions {fid.describe(i)}{other} (calibration {path.name}, "
           f"{fid.windows} windows{'' if fid.held_out else ', the calibration text itself'})")
    return chosen, why


def _check_bound(fid: Fidelity, auto: Auto, i: int, path: Path) -> None:
    """Refuse a choice measured to lose more than auto.max_loss on a domain, naming the smallest measured ratio whose
    choice stays within it."""
    head = f"auto:ratio={auto.ratio:g},max_loss={auto.max_loss:g}: "
    if not fid.probed[i]:
        raise SparqError(head + f"{path} has no end-to-end probe to bound the loss by; calibrate the model again with "
                                "the probe")
    if fid.worst_relative(i) <= auto.max_loss:
        return
    within = next((x for x in sorted(fid.ratio) if fid.probed[j := choose(fid, x)]
                   and fid.worst_relative(j) <= auto.max_loss), None)
    raise SparqError(head + f"at ratio {fid.ratio[i]:.4g} the calibration ({path.name}) measured its choice, "
                     f"{fid.method[i]} {'r' if fid.method[i] == 'sparq' else 'd'}={fid.rank[i]}, losing "
                     f"{fid.worst_relative(i):+.1%} bits per character on its worst domain, more than "
                     f"{auto.max_loss:g}; " + (f"the smallest measured ratio within it is {within:.4g}"
                                               if within is not None else "no measured ratio stays within it"))


def known_poor(attention, model_path, summary, projection=None) -> str | None:
    """A warning for a fixed SparQ or Loki setting known to be a poor choice on this model, or None."""
    if not isinstance(attention, (SparQ, Loki)):
        return None
    path = Path(projection) if projection is not None else default_projection(Path(model_path))
    fid = None
    if path.is_file():
        try:
            fid = read_fidelity(path)
        except SparqError:
            fid = None
    if fid is None:  # nothing measured on this model: no claim either way
        return None
    D, n = summary.head_dim, fid.ctx
    rank = attention.r if isinstance(attention, SparQ) else attention.d
    elements = (transfer.sparq_elements if isinstance(attention, SparQ) else transfer.loki_elements)(n, D, rank,
                                                                                                    attention.k)
    ratio = elements / transfer.dense_elements(n, D)
    # compared with the candidates of the largest measured ratio the setting's reads reach within 2% (a setting at
    # 0.12494 belongs to the 1/8 row, not to the 1/16 row below it; the rows are a factor 2 apart); the figures and
    # the suggestion quoted are that row's
    base = _measured_ratio(fid, ratio * 1.02)
    mine = choose(fid, base, attention.name)
    best = choose(fid, base)
    if fid.method[best] == attention.name:
        return None
    where = f"at {ratio:.3g} of dense reads (the calibration's row for 1/{round(1 / base)})"
    if fid.probed[best] and fid.probed[mine]:
        if fid.probe_loss(best) <= fid.probe_loss(mine) - POOR_PROBE_MARGIN:
            return (f"{where}, this model's calibration ({path.name}) measured {fid.describe(best)}; "
                    f"{attention.name} at best loses {fid.worst_text(mine):+.3f} bits per character on text (its "
                    f"worst domain, {fid.worst_domain(mine)}, {fid.worst_relative(mine):+.1%}) and "
                    f"{fid.probe_copy[mine]:+.3f} on a retrieval: --attn auto --ratio 1/{round(1 / base)} picks the "
                    "former")
    elif fid.mean_error(best) <= fid.mean_error(mine) - POOR_MARGIN:
        return (f"{where}, this model's calibration ({path.name}) measured {fid.describe(best)}, "
                f"{attention.name} at best an output error of {fid.mean_error(mine):.3f}: --attn auto --ratio "
                f"1/{round(1 / base)} picks the former")
    return None
