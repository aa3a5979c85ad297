"""Loki calibration: capture keys in llama.cpp (capture), fit a PCA per layer and KV head (pca),
store the bases in a GGUF (projection; sparq_cpp.projection reads it back); run.calibrate does the
first two, figure draws Figure 2."""

from sparq_cpp.calib.pca import VARIANTS, KeyMoments, LokiPCA, rank_at
from sparq_cpp.calib.projection import embed_projection, write_projection
from sparq_cpp.calib.run import calibrate
from sparq_cpp.projection import LokiProjection, model_fingerprint, read_projection

__all__ = ["VARIANTS", "KeyMoments", "LokiPCA", "rank_at", "LokiProjection", "embed_projection",
           "model_fingerprint", "read_projection", "write_projection", "calibrate"]
