#include "sparse-attn.h"

#include "common.h"
#include "gguf.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

bool common_sparse_attn_is_auto(const std::string & spec) {
    return spec == "auto" || spec.rfind("auto:", 0) == 0;
}

// a number or a fraction of integers; nothing else in the string
static bool sa_parse_ratio(const std::string & s, double & out) {
    const size_t slash = s.find('/');
    char * end = nullptr;
    if (slash != std::string::npos) {
        const std::string num = s.substr(0, slash);
        const std::string den = s.substr(slash + 1);
        auto is_int = [](const std::string & t) {
            size_t i = (!t.empty() && (t[0] == '+' || t[0] == '-')) ? 1 : 0;
            if (i == t.size()) {
                return false;
            }
            for (; i < t.size(); ++i) {
                if (t[i] < '0' || t[i] > '9') {
                    return false;
                }
            }
            return true;
        };
        if (!is_int(num) || !is_int(den)) {
            return false;
        }
        const double d = std::strtod(den.c_str(), nullptr);
        if (d == 0.0) {
            return false;
        }
        out = std::strtod(num.c_str(), nullptr) / d;
        return true;
    }
    if (s.empty() || s.find_first_not_of("0123456789+-.eE") != std::string::npos) {
        return false;
    }
    out = std::strtod(s.c_str(), &end);
    return end == s.c_str() + s.size();
}

bool common_sparse_attn_auto_parse(const std::string & spec, common_sparse_attn_auto & out, std::string & err) {
    if (!common_sparse_attn_is_auto(spec)) {
        err = "expected auto[:ratio=R,proj=FILE,max_loss=B]";
        return false;
    }
    common_sparse_attn_auto res;
    std::set<std::string> seen;
    const std::string rest = spec.size() > 5 ? spec.substr(5) : "";
    size_t pos = 0;
    while (!rest.empty() && pos <= rest.size()) {
        size_t comma = rest.find(',', pos);
        if (comma == std::string::npos) {
            comma = rest.size();
        }
        const std::string item = rest.substr(pos, comma - pos);
        pos = comma + 1;

        const size_t eq = item.find('=');
        if (eq == std::string::npos || eq + 1 == item.size()) {
            err = "'" + item + "' is not key=value";
            return false;
        }
        const std::string key = item.substr(0, eq);
        const std::string val = item.substr(eq + 1);
        if (!seen.insert(key).second) {
            err = key + " given twice";
            return false;
        }
        if (key == "ratio") {
            if (!sa_parse_ratio(val, res.ratio)) {
                err = "ratio '" + val + "' is not a number or fraction like 1/8";
                return false;
            }
            if (!(res.ratio > 0.0 && res.ratio < 1.0)) {
                err = "ratio must be in (0, 1): attention data read / dense, got " + val;
                return false;
            }
        } else if (key == "proj") {
            res.proj = val;
        } else if (key == "max_loss") {
            if (!sa_parse_ratio(val, res.max_loss) || !(res.max_loss > 0.0 && res.max_loss < 1.0)) {
                err = "max_loss must be a number in (0, 1): bits per character lost / dense's, got " + val;
                return false;
            }
        } else {
            err = "unknown key '" + key + "' for auto (ratio, proj, max_loss)";
            return false;
        }
    }
    out = res;
    return true;
}

// the calibration's fidelity measurement (loki.fidelity.*): per candidate its method, ratio, rank, k and l at ctx
// positions, and per measured layer ([candidate][layer]) the relative error of its attention output and the
// attention mass it kept, with the exact top-k's at its k
struct sa_fidelity {
    uint32_t ctx     = 0;
    uint32_t windows = 0;
    bool held_out    = false;
    size_t   n_layer = 0;

    std::vector<std::string> method;
    std::vector<double>      ratio;
    std::vector<int64_t>     rank, k, l, sink;
    std::vector<double>      mass, exact_mass, error, exact_error;

    // the end-to-end probe (optional): per candidate, whether probed and the bits per character lost on text and
    // on a retrieval; dense's own (text, retrieval)
    std::vector<int64_t> probed;
    std::vector<double>  probe_text, probe_copy, probe_dense;

    // the text per domain (optional): names, the loss per candidate and domain ([candidate][domain]), dense's
    std::vector<std::string> domains;
    std::vector<double>      domain_loss, domain_dense;
};

static bool sa_get_int(const gguf_context * ctx, int64_t id, size_t i, int64_t & out) {
    const bool arr = gguf_get_kv_type(ctx, id) == GGUF_TYPE_ARRAY;
    const gguf_type t = arr ? gguf_get_arr_type(ctx, id) : gguf_get_kv_type(ctx, id);
    const void * data = arr ? gguf_get_arr_data(ctx, id) : gguf_get_val_data(ctx, id);
    switch (t) {
        case GGUF_TYPE_UINT8:  out = ((const uint8_t  *) data)[i]; return true;
        case GGUF_TYPE_INT8:   out = ((const int8_t   *) data)[i]; return true;
        case GGUF_TYPE_UINT16: out = ((const uint16_t *) data)[i]; return true;
        case GGUF_TYPE_INT16:  out = ((const int16_t  *) data)[i]; return true;
        case GGUF_TYPE_UINT32: out = ((const uint32_t *) data)[i]; return true;
        case GGUF_TYPE_INT32:  out = ((const int32_t  *) data)[i]; return true;
        case GGUF_TYPE_UINT64: out = (int64_t) ((const uint64_t *) data)[i]; return true;
        case GGUF_TYPE_INT64:  out = ((const int64_t  *) data)[i]; return true;
        case GGUF_TYPE_BOOL:   out = ((const int8_t   *) data)[i] != 0; return true;
        default: return false;
    }
}

static bool sa_get_float(const gguf_context * ctx, int64_t id, size_t i, double & out) {
    if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY) {
        return false;
    }
    const void * data = gguf_get_arr_data(ctx, id);
    switch (gguf_get_arr_type(ctx, id)) {
        case GGUF_TYPE_FLOAT32: out = ((const float  *) data)[i]; return true;
        case GGUF_TYPE_FLOAT64: out = ((const double *) data)[i]; return true;
        default: return false;
    }
}

// false with err when the file has no measurement (err empty) or a malformed one
static bool sa_read_fidelity(const std::string & path, sa_fidelity & fid, std::string & err) {
    gguf_init_params gparams = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    std::unique_ptr<gguf_context, decltype(&gguf_free)> ctx(gguf_init_from_file(path.c_str(), gparams), gguf_free);
    if (!ctx) {
        err = path + " is not a readable GGUF file";
        return false;
    }
    const gguf_context * g = ctx.get();

    if (gguf_find_key(g, "loki.fidelity.ctx") < 0) {
        return false; // calibrated without the measurement
    }
    auto bad = [&](const std::string & name, const std::string & what) {
        err = path + ": loki.fidelity." + name + " " + what + "; calibrate the model again";
        return false;
    };
    // the key's id, or -1 (err set) when it is missing or not an array as expected
    auto find = [&](const char * name, bool array) -> int64_t {
        const int64_t id = gguf_find_key(g, (std::string("loki.fidelity.") + name).c_str());
        if (id < 0) {
            bad(name, "is missing");
        } else if ((gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY) != array) {
            bad(name, array ? "must be an array" : "must be a single value");
            return -1;
        }
        return id;
    };
    auto scalar = [&](const char * name, int64_t & out) {
        const int64_t id = find(name, false);
        return id >= 0 && (sa_get_int(g, id, 0, out) || bad(name, "must be an integer"));
    };

    int64_t v = 0;
    if (!scalar("ctx", v)) {
        return false;
    }
    fid.ctx = (uint32_t) v;
    if (!scalar("windows", v)) {
        return false;
    }
    fid.windows = (uint32_t) v;
    if (!scalar("held_out", v)) {
        return false;
    }
    fid.held_out = v != 0;

    const int64_t id_layers = find("layers", true);
    const int64_t id_method = find("method", true);
    if (id_layers < 0 || id_method < 0) {
        return false;
    }
    fid.n_layer = gguf_get_arr_n(g, id_layers);
    if (gguf_get_arr_type(g, id_method) != GGUF_TYPE_STRING) {
        return bad("method", "must hold strings");
    }
    const size_t n = gguf_get_arr_n(g, id_method);
    for (size_t i = 0; i < n; ++i) {
        fid.method.emplace_back(gguf_get_arr_str(g, id_method, i));
        if (fid.method.back() != "sparq" && fid.method.back() != "loki") {
            return bad("method", "holds an unknown method '" + fid.method.back() + "'");
        }
    }
    if (n == 0 || fid.n_layer == 0) {
        return bad(n == 0 ? "method" : "layers", "is empty");
    }

    // per candidate
    auto ints = [&](const char * name, std::vector<int64_t> & out) {
        const int64_t id = find(name, true);
        if (id < 0) {
            return false;
        }
        if (gguf_get_arr_n(g, id) != n) {
            return bad(name, string_format("must hold %zu values, one per candidate", n));
        }
        for (size_t i = 0; i < n; ++i) {
            if (!sa_get_int(g, id, i, v)) {
                return bad(name, "must hold integers");
            }
            out.push_back(v);
        }
        return true;
    };
    // per candidate, or per candidate and layer
    auto floats = [&](const char * name, size_t count, bool finite, std::vector<double> & out) {
        const int64_t id = find(name, true);
        if (id < 0) {
            return false;
        }
        if (gguf_get_arr_n(g, id) != count) {
            return bad(name, string_format("must hold %zu values", count));
        }
        for (size_t i = 0; i < count; ++i) {
            double x = 0.0;
            if (!sa_get_float(g, id, i, x) || (finite && !std::isfinite(x))) {
                return bad(name, finite ? "must hold finite floats" : "must hold floats");
            }
            out.push_back(x);
        }
        return true;
    };
    if (!ints("rank", fid.rank) || !ints("k", fid.k) || !ints("l", fid.l) ||
        !floats("ratio", n, false, fid.ratio) ||
        !floats("mass", n * fid.n_layer, true, fid.mass) ||
        !floats("exact_mass", n * fid.n_layer, true, fid.exact_mass) ||
        !floats("error", n * fid.n_layer, true, fid.error) ||
        !floats("exact_error", n * fid.n_layer, true, fid.exact_error)) {
        return false;
    }
    for (size_t i = 0; i < n; ++i) {
        if (fid.k[i] < 1) {
            return bad("k", "must hold positive values");
        }
    }

    // optional: calibrations without them keep no first position and have no probe
    if (gguf_find_key(g, "loki.fidelity.sink") >= 0) {
        if (!ints("sink", fid.sink)) {
            return false;
        }
        for (size_t i = 0; i < n; ++i) {
            if (fid.sink[i] < 0) {
                return bad("sink", "must hold values >= 0");
            }
        }
    } else {
        fid.sink.assign(n, 0);
    }
    if (gguf_find_key(g, "loki.fidelity.probed") >= 0) {
        if (!ints("probed", fid.probed) || !floats("probe_text", n, true, fid.probe_text) ||
            !floats("probe_copy", n, true, fid.probe_copy) || !floats("probe_dense", 2, true, fid.probe_dense)) {
            return false;
        }
        const bool any_domain = gguf_find_key(g, "loki.fidelity.probe_domains") >= 0 ||
                                gguf_find_key(g, "loki.fidelity.probe_domain_loss") >= 0 ||
                                gguf_find_key(g, "loki.fidelity.probe_domain_dense") >= 0;
        if (any_domain) {
            const int64_t id = gguf_find_key(g, "loki.fidelity.probe_domains");
            const bool strings = id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY &&
                                 gguf_get_arr_type(g, id) == GGUF_TYPE_STRING;
            const size_t m = strings ? gguf_get_arr_n(g, id) : 0;
            for (size_t j = 0; j < m; ++j) {
                fid.domains.emplace_back(gguf_get_arr_str(g, id, j));
            }
            std::set<std::string> distinct(fid.domains.begin(), fid.domains.end());
            if (m == 0 || distinct.size() != m || distinct.count("")) {
                return bad("probe_domains", "must name one or more distinct domains");
            }
            if (!floats("probe_domain_loss", n * m, true, fid.domain_loss) ||
                !floats("probe_domain_dense", m, true, fid.domain_dense)) {
                return false;
            }
        }
    } else {
        fid.probed.assign(n, 0);
        fid.probe_text.assign(n, 0.0);
        fid.probe_copy.assign(n, 0.0);
    }
    return true;
}

// numpy's pairwise summation, so that the mean over the layers (and so the choice) is bit for bit the one the
// calibration tools compute
static double sa_pairwise_sum(const double * a, size_t n) {
    if (n < 8) {
        double res = 0.0;
        for (size_t i = 0; i < n; ++i) {
            res += a[i];
        }
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; ++j) {
            r[j] = a[j];
        }
        size_t i = 8;
        for (; i < n - (n % 8); i += 8) {
            for (int j = 0; j < 8; ++j) {
                r[j] += a[i + j];
            }
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) {
            res += a[i];
        }
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return sa_pairwise_sum(a, n2) + sa_pairwise_sum(a + n2, n - n2);
}

static double sa_mean(const std::vector<double> & m, size_t i, size_t n_layer) {
    return sa_pairwise_sum(m.data() + i * n_layer, n_layer) / (double) n_layer;
}

// the largest measured ratio not above target (stored as f32: compared with a little slack), else the smallest
static double sa_measured_ratio(const sa_fidelity & fid, double target) {
    double below = -1.0;
    double least = fid.ratio[0];
    for (double x : fid.ratio) {
        least = std::min(least, x);
        if (x <= target * (1 + 1e-6)) {
            below = std::max(below, x);
        }
    }
    return below >= 0.0 ? below : least;
}

// candidate i's loss on domain j relative to dense's bits per character there
static double sa_relative(const sa_fidelity & fid, size_t i, size_t j) {
    const size_t m = fid.domains.size();
    return fid.domain_dense[j] > 0.0 ? fid.domain_loss[i * m + j] / fid.domain_dense[j] : 0.0;
}

// the largest loss of a probed candidate relative to dense's bits per character, over the domains (or the text)
static double sa_worst_relative(const sa_fidelity & fid, size_t i) {
    if (fid.domains.empty()) {
        return fid.probe_dense[0] > 0.0 ? fid.probe_text[i] / fid.probe_dense[0] : 0.0;
    }
    const size_t m = fid.domains.size();
    double res = 0.0;
    for (size_t j = 0; j < m; ++j) {
        res = j == 0 ? sa_relative(fid, i, j) : std::max(res, sa_relative(fid, i, j));
    }
    return res;
}

// what auto minimises: for a probed candidate, its worst domain's loss relative to dense's bits per character there
// plus the bits per character lost on the retrieval (without domains, an older calibration: the bits per character
// lost on text and retrieval together); else the mean output error
static double sa_score(const sa_fidelity & fid, size_t i) {
    if (!fid.probed[i]) {
        return sa_mean(fid.error, i, fid.n_layer);
    }
    return (fid.domains.empty() ? fid.probe_text[i] : sa_worst_relative(fid, i)) + fid.probe_copy[i];
}

// the candidate at the measured ratio for target (of method only, if not empty) of least sa_score among the probed
// ones, or among all when none was probed; the first on a tie; -1 if none
static int sa_choose(const sa_fidelity & fid, double target, const std::string & method = "") {
    const double base = sa_measured_ratio(fid, target);
    bool any_probed = false;
    for (size_t i = 0; i < fid.method.size(); ++i) {
        any_probed |= fid.ratio[i] == base && (method.empty() || fid.method[i] == method) && fid.probed[i];
    }
    int best = -1;
    double best_score = 0.0;
    for (size_t i = 0; i < fid.method.size(); ++i) {
        if (fid.ratio[i] != base || (!method.empty() && fid.method[i] != method) || (any_probed && !fid.probed[i])) {
            continue;
        }
        const double e = sa_score(fid, i);
        if (best < 0 || e < best_score) {
            best       = (int) i;
            best_score = e;
        }
    }
    return best;
}

// Python's float // int, which the reference transfer model uses
static double sa_floordiv(double a, double b) {
    const double mod = std::fmod(a, b);
    double div = (a - mod) / b;
    if (mod != 0.0 && ((b < 0) != (mod < 0))) {
        div -= 1.0;
    }
    double floordiv = 0.0;
    if (div != 0.0) {
        floordiv = std::floor(div);
        if (div - floordiv > 0.5) {
            floordiv += 1.0;
        }
    } else {
        floordiv = std::copysign(0.0, a / b);
    }
    return floordiv;
}

// attention elements one decode step reads per KV head at n positions (dense, and SparQ or Loki with rank and k)
static int64_t sa_dense_elements(int64_t n, int64_t D) {
    return 2 * n * D + 2 * D;
}

static int64_t sa_sparse_elements(bool sparq, int64_t n, int64_t D, int64_t rank, int64_t k) {
    k = std::min(k, n);
    return n * rank + 2 * k * D + (sparq ? 4 : 2) * D;
}

// the largest k whose reads stay within target times dense at n positions; below 1 when none does
static int64_t sa_largest_k(bool sparq, double target, int64_t n, int64_t D, int64_t rank) {
    const double  budget = target * (double) sa_dense_elements(n, D);
    const int64_t r1     = sa_sparse_elements(sparq, n, D, rank, 1);
    const int64_t slope  = sa_sparse_elements(sparq, n, D, rank, 2) - r1;
    if (slope <= 0) {
        return 0;
    }
    return (int64_t) sa_floordiv(budget - (double) (r1 - slope), (double) slope);
}

std::string common_sparse_attn_default_projection(const std::string & model_path) {
    const std::filesystem::path p(model_path);
    return (p.parent_path() / (p.stem().string() + ".loki.gguf")).string();
}

static int32_t sa_head_dim(const llama_model * model) {
    char arch[64] = "";
    char buf[64]  = "";
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof(arch)) > 0 &&
        llama_model_meta_val_str(model, (std::string(arch) + ".attention.key_length").c_str(), buf, sizeof(buf)) > 0) {
        const int32_t v = std::atoi(buf);
        if (v > 0) {
            return v;
        }
    }
    const int32_t n_head = llama_model_n_head(model);
    return n_head > 0 ? llama_model_n_embd(model) / n_head : 0;
}

bool common_sparse_attn_auto_resolve(
        const common_sparse_attn_auto & req,
                        llama_model * model,
                  const std::string & model_path,
                            int32_t   n_ctx,
           llama_sparse_attn_params & out,
                        std::string & proj,
                        std::string & why,
                        std::string & err) {
    const std::string path = req.proj.empty() ? common_sparse_attn_default_projection(model_path) : req.proj;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) {
        err = "--sparse-attn auto chooses from a calibration of the model, and " + path + " does not exist: "
              "calibrate the model (it writes that file), or give the file as auto:proj=FILE";
        return false;
    }

    // the calibration must be of this model: its basis is checked (and kept for a Loki context) as Loki's would be
    const int32_t rc = llama_sparse_attn_load_projection(model, path.c_str(), false);
    if (rc != 0) {
        err = path + " is not a calibration of this model: " + llama_sparse_attn_strerror(rc);
        return false;
    }

    sa_fidelity fid;
    if (!sa_read_fidelity(path, fid, err)) {
        if (err.empty()) {
            err = path + " has no fidelity measurement (loki.fidelity.*, an older calibration); calibrate the model "
                  "again for --sparse-attn auto";
        }
        return false;
    }

    const int32_t D = sa_head_dim(model);
    if (D <= 0) {
        err = "--sparse-attn auto: the model has no attention head size";
        return false;
    }
    const int    i     = sa_choose(fid, req.ratio);
    const double base  = fid.ratio[i];
    const bool   sparq = fid.method[i] == "sparq";

    if (req.max_loss > 0.0) { // refuse to promise less than was measured
        const std::string name = std::filesystem::path(path).filename().string();
        const std::string head = string_format("auto:ratio=%g,max_loss=%g: ", req.ratio, req.max_loss);
        if (!fid.probed[i]) {
            err = head + path + " has no end-to-end probe to bound the loss by; calibrate the model again with the "
                  "probe";
            return false;
        }
        if (sa_worst_relative(fid, i) > req.max_loss) {
            std::vector<double> measured(fid.ratio.begin(), fid.ratio.end());
            std::sort(measured.begin(), measured.end());
            double within = -1.0;
            for (double x : measured) {
                const int j = sa_choose(fid, x);
                if (fid.probed[j] && sa_worst_relative(fid, j) <= req.max_loss) {
                    within = x;
                    break;
                }
            }
            err = head + string_format("at ratio %.4g the calibration (%s) measured its choice, %s %s=%lld, losing "
                    "%+.1f%% bits per character on its worst domain, more than %g; ", base, name.c_str(),
                    fid.method[i].c_str(), sparq ? "r" : "d", (long long) fid.rank[i],
                    sa_worst_relative(fid, i) * 100.0, req.max_loss);
            err += within > 0.0 ? string_format("the smallest measured ratio within it is %.4g", within)
                                : std::string("no measured ratio stays within it");
            return false;
        }
    }

    // the measured rank scaled to the target ratio (round half to even, as the calibration tools do)
    const double  scaled = std::nearbyint((double) fid.rank[i] * req.ratio / base);
    const int64_t rank   = std::max<int64_t>(1, std::min<int64_t>(D, (int64_t) scaled));
    const int64_t k      = n_ctx >= 2 ? sa_largest_k(sparq, req.ratio, n_ctx, D, rank) : 0;
    if (k < 1) {
        err = string_format("auto:ratio=%g: no %s setting reads that little at a context of %d positions; "
                            "raise the ratio or the context size", req.ratio, fid.method[i].c_str(), n_ctx);
        return false;
    }
    // the measured share of k
    const int64_t l    = (int64_t) ((double) (k * fid.l[i]) / (double) fid.k[i]);
    const int64_t sink = std::min<int64_t>(fid.sink[i], k - l);

    out = llama_sparse_attn_default_params();
    proj.clear();
    if (sparq) {
        out.mode       = LLAMA_SPARSE_ATTN_SPARQ;
        out.r          = (int32_t) rank;
        // the paper's choice: mean-value reallocation off for GQA models
        out.mean_value = llama_model_n_head(model) == llama_model_n_head_kv(model);
    } else {
        out.mode          = LLAMA_SPARSE_ATTN_LOKI;
        out.d             = (int32_t) rank;
        out.loki_pre_rope = false;
        proj              = path;
    }
    out.k    = (int32_t) k;
    out.l    = (int32_t) l;
    out.sink = (int32_t) sink;

    auto describe = [&](int j) {
        std::string res = string_format("%s %s=%lld k=%lld l=%lld sink=%lld: output error %.3f (exact top-k %.3f), "
                "keeps %.3f of the attention", fid.method[j].c_str(), fid.method[j] == "sparq" ? "r" : "d",
                (long long) fid.rank[j], (long long) fid.k[j], (long long) fid.l[j], (long long) fid.sink[j],
                sa_mean(fid.error, j, fid.n_layer), sa_mean(fid.exact_error, j, fid.n_layer), sa_mean(fid.mass, j, fid.n_layer));
        if (fid.probed[j] && !fid.domains.empty()) {
            const size_t m = fid.domains.size();
            std::string per;
            size_t worst = 0;
            for (size_t d = 0; d < m; ++d) {
                const double x = fid.domain_loss[j * m + d];
                per += (d ? ", " : "") + fid.domains[d] + string_format(" %+.3f", x);
                if (fid.domain_dense[d] > 0.0) {
                    per += string_format(" (%+.1f%%)", x / fid.domain_dense[d] * 100.0);
                }
                if (sa_relative(fid, j, d) > sa_relative(fid, j, worst)) {
                    worst = d;
                }
            }
            res += ", loses bits per character on text per domain: " + per + " (worst " + fid.domains[worst] +
                   string_format("), and %+.3f on a retrieval", fid.probe_copy[j]);
        } else if (fid.probed[j]) {
            res += string_format(", loses %+.3f bits per character on text and %+.3f on a retrieval", fid.probe_text[j],
                    fid.probe_copy[j]);
        }
        return res;
    };
    std::string other;
    for (size_t j = 0; j < fid.method.size(); ++j) {
        if (fid.ratio[j] == base && fid.method[j] != fid.method[i]) {
            const int b = sa_choose(fid, req.ratio, fid.method[j]);
            other = string_format("; best %s: %.3f", fid.method[j].c_str(), sa_score(fid, b));
            break;
        }
    }
    why = string_format("auto:ratio=%g -> %s (%s=%lld, k=%lld, l=%lld, sink=%lld at n_ctx=%d): at %u positions ",
            req.ratio, fid.method[i].c_str(), sparq ? "r" : "d", (long long) rank, (long long) k, (long long) l,
            (long long) sink, n_ctx, fid.ctx);
    why += describe(i) + other;
    why += string_format(" (calibration %s, %u windows%s)", std::filesystem::path(path).filename().string().c_str(),
            fid.windows, fid.held_out ? "" : ", the calibration text itself");
    return true;
}

std::string common_sparse_attn_describe(const llama_sparse_attn_params & p) {
    const int32_t l = p.l >= 0 ? p.l : p.k / 4;
    switch (p.mode) {
        case LLAMA_SPARSE_ATTN_SPARQ:
            return string_format("sparq (r = %d, k = %d, l = %d, sink = %d, mean value %s%s)", p.r, p.k, l, p.sink,
                                 p.mean_value ? "on" : "off", p.sparse_prompt ? ", sparse prompt" : "");
        case LLAMA_SPARSE_ATTN_LOKI:
            return string_format("loki (d = %d, k = %d, l = %d, sink = %d%s%s)", p.d, p.k, l, p.sink,
                                 p.loki_proj ? ", projection " : "", p.loki_proj ? p.loki_proj : "");
        case LLAMA_SPARSE_ATTN_ALISA:
            return string_format("alisa (c = %g)", p.c);
        default:
            return "dense";
    }
}
