"""Writes the GPU check's model: an n-layer q8_0 GGUF of a sparq_cpp.modelfactory preset (default: 8 layers of
llama2-7b), seed 0, with the bundle's copies of sparq_cpp and gguf (py/ beside this file); numpy, tqdm, pyyaml and
requests come from the Python that runs it. --loki also writes <model stem>.loki.gguf, a Loki projection for timing:
per layer and KV head, the basis that orders the key dimensions by the factory's per-row scale of attn_k (largest
first; rotary pairs stay together), for both variants. Prints one JSON line.

    python3 write_model.py OUT.gguf [LAYERS] [PRESET] [--loki]
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "py"))

import numpy as np  # noqa: E402

from sparq_cpp.modelfactory import qk_row_std, resolve_geometry, write_model  # noqa: E402


def write_loki(model: Path, preset: str, layers: int, seed: int = 0) -> Path:
    from sparq_cpp.calib.pca import LokiPCA
    from sparq_cpp.calib.projection import write_projection

    g = resolve_geometry(preset, layers=layers, wtype="q8_0")
    D, H, L = g.head_dim, g.n_head_kv, g.n_layer
    P = np.zeros((L, H, D, D))
    var = np.zeros((L, H, D))
    for il in range(L):
        std = qk_row_std(g, seed, il, H).reshape(H, D)
        for h in range(H):
            order = np.argsort(-std[h], kind="stable")
            P[il, h, order, np.arange(D)] = 1.0
            var[il, h] = std[h][order] ** 2
    pca = LokiPCA(components={"pre": P, "post": P}, explained_variance={"pre": var, "post": var}, n_tokens=1)
    return write_projection(model.parent / (model.stem + ".loki.gguf"), pca, model, ctx_size=g.n_ctx_train)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0])
    layers = int(args[1]) if len(args) > 1 else 8
    preset = args[2] if len(args) > 2 else "llama2-7b"
    t0 = time.time()
    path = write_model(out, preset, layers=layers, wtype="q8_0", seed=0, make_parents=True)
    info = {"model": str(path), "bytes": path.stat().st_size, "seconds": round(time.time() - t0, 1),
            "preset": preset, "layers": layers}
    if "--loki" in sys.argv[1:]:
        info["loki"] = str(write_loki(path, preset, layers))
    info["modules"] = {m: sys.modules[m].__file__ for m in ("gguf", "sparq_cpp", "numpy")}
    print(json.dumps(info))


if __name__ == "__main__":
    main()
