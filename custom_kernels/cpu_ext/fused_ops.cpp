// CPU primitives for the per-token ops around the mat-vecs (eval_cpu only): the RMS norm, the
// non-interleaved RoPE, the SiLU gate and the softmax, one graph op each. MLX 0.32.4's CPU back end has no kernel for
// mx.fast.rms_norm or mx.fast.rope and runs their fallbacks, 4-5 and ~10 ops per call: a
// SmolLM2-135M decode step was 2,209 ops, ~900 of them these two (each op ~4 us of dispatch on
// a 2-core machine). float32 only (the CPU path's dtype); any strides in, contiguous out.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace mx = mlx::core;
namespace nb = nanobind;

// Offset (in elements) of the first element of row r of x, a row being the last axis (the
// leading dims flattened, row-major). Also ggml_matvec.cpp's, which declares it.
int64_t row_offset(const mx::array& x, int64_t r) {
  int64_t off = 0;
  for (int d = int(x.ndim()) - 2; d >= 0; --d) {
    const int64_t n = x.shape(d);
    off += (r % n) * int64_t(x.strides()[d]);
    r /= n;
  }
  return off;
}

namespace {

// What every primitive here shares: eval_cpu only, one output of the first input's shape in a
// fresh contiguous buffer, parameterless ones equivalent to each other (the others override).
class CpuPrimitive : public mx::UnaryPrimitive {
 public:
  explicit CpuPrimitive(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 protected:
  // out's buffer allocated, the inputs and out registered: the encoder to dispatch on
  mx::cpu::CommandEncoder& encoder(const std::vector<mx::array>& inputs, mx::array& out) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    return enc;
  }
};

// y = x * rsqrt(mean(x^2) + eps) (* w) over the last axis; the sum of squares in double, the
// rest in float, as transformers' fp32 RMSNorm up to the summation order.
class RMSNormCPU : public CpuPrimitive {
 public:
  RMSNormCPU(mx::Stream s, float eps, bool has_w) : CpuPrimitive(s), eps_(eps), w_(has_w) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder(inputs, out);
    const mx::array x = inputs[0];
    const std::optional<mx::array> w = w_ ? std::optional<mx::array>(inputs[1]) : std::nullopt;
    enc.dispatch([x, w, out, eps = eps_]() mutable {
      const int64_t D = x.shape(-1), rows = D ? int64_t(x.size()) / D : 0;
      const int64_t sx = x.strides().back();
      const float* xp = x.data<float>();
      const float* wp = w ? w->data<float>() : nullptr;
      const int64_t sw = w ? int64_t(w->strides().back()) : 0;
      float* yp = out.data<float>();
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + row_offset(x, r);
        double ss = 0.0;
        for (int64_t i = 0; i < D; ++i) ss += double(xr[i * sx]) * double(xr[i * sx]);
        const float inv = 1.0f / std::sqrt(float(ss / double(D)) + eps);
        float* yr = yp + r * D;
        if (wp)
          for (int64_t i = 0; i < D; ++i) yr[i] = (xr[i * sx] * inv) * wp[i * sw];
        else
          for (int64_t i = 0; i < D; ++i) yr[i] = xr[i * sx] * inv;
      }
    });
  }

  const char* name() const override { return "RMSNormCPU"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNormCPU&>(other);
    return eps_ == o.eps_ && w_ == o.w_;
  }

 private:
  float eps_;
  bool w_;
};

// Non-interleaved RoPE of x (B, H, L, D): pair i of the first `dims` channels (i, i + dims / 2)
// turns by theta = position * scale * inv_freq[i]; channels past dims are copied. offset, int32:
// (1,) or (B,) first positions (token l at offset_b + l), or (1 or B, L) a position per token.
class RopeCPU : public CpuPrimitive {
 public:
  RopeCPU(mx::Stream s, int dims, float scale) : CpuPrimitive(s), dims_(dims), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder(inputs, out);
    const mx::array x = inputs[0], off = inputs[1], inv = inputs[2];
    enc.dispatch([x, off, inv, out, dims = dims_, scale = scale_]() mutable {
      const int64_t B = x.shape(0), H = x.shape(1), L = x.shape(2), D = x.shape(3);
      const int64_t half = dims / 2;
      const auto& st = x.strides();
      const float* xp = x.data<float>();
      const int32_t* op = off.data<int32_t>();
      const float* ip = inv.data<float>();
      const int64_t si = inv.strides()[0];
      float* yp = out.data<float>();
      std::vector<float> cs(size_t(2 * half));
      const bool per_token = off.ndim() == 2;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t ob = off.shape(0) == 1 ? 0 : b * off.strides()[0];
        for (int64_t l = 0; l < L; ++l) {
          const int64_t pos = per_token ? op[ob + l * off.strides()[1]] : op[ob] + l;
          const float p = float(pos) * scale;
          for (int64_t i = 0; i < half; ++i) {
            const float th = p * ip[i * si];
            cs[2 * i] = std::cos(th);
            cs[2 * i + 1] = std::sin(th);
          }
          for (int64_t h = 0; h < H; ++h) {
            const float* xr = xp + b * st[0] + h * st[1] + l * st[2];
            float* yr = yp + ((b * H + h) * L + l) * D;
            const int64_t s3 = st[3];
            for (int64_t i = 0; i < half; ++i) {
              const float x1 = xr[i * s3], x2 = xr[(i + half) * s3];
              const float c = cs[2 * i], s = cs[2 * i + 1];
              yr[i] = x1 * c - x2 * s;
              yr[i + half] = x1 * s + x2 * c;
            }
            for (int64_t i = 2 * half; i < D; ++i) yr[i] = xr[i * s3];
          }
        }
      }
    });
  }

  const char* name() const override { return "RopeCPU"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeCPU&>(other);
    return dims_ == o.dims_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  float scale_;
};

// MLX 0.32.4's CPU exp (mlx/backend/cpu/simd/math.h, exp<float, N>) step for step: on x86 MLX
// runs it one element at a time with each fma a libm call (~12 ns an element); written here
// over whole rows so the compiler vectorizes it, with the same operations in the same order
// and the fmas fused as MLX's are (this file is built with -ffp-contract=off), so each result
// is MLX's bit for bit.
inline float mlx_exp(float x_init) {
  float x = x_init * 1.442695f;
  const float ipart = std::floor(x + 0.5f);
  const float fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = std::fma(x, fpart, 1.339887440266574e-3f);
  x = std::fma(x, fpart, 9.618437357674640e-3f);
  x = std::fma(x, fpart, 5.550332471162809e-2f);
  x = std::fma(x, fpart, 2.402264791363012e-1f);
  x = std::fma(x, fpart, 6.931472028550421e-1f);
  x = std::fma(x, fpart, 1.000000000000000f);
  const int32_t epart = (int32_t(ipart) + 127) << 23;
  float scale;
  std::memcpy(&scale, &epart, sizeof(scale));
  float r = std::isnan(x_init) ? x_init : scale * x;
  r = x_init > 88.0f ? std::numeric_limits<float>::infinity() : r;
  return x_init < -88.0f ? 0.0f : r;
}

// MLX's CPU sigmoid (unary_ops.h, Sigmoid) on mlx_exp.
inline float mlx_sigmoid(float x) {
  const float y = 1.0f / (1.0f + mlx_exp(std::fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}

// silu(gate) * up = (gate * sigmoid(gate)) * up over the last axis, gate and up each (..., F)
// with any strides (the halves of a fused [gate | up] projection among them); out contiguous.
// The products in the order of ops.gated_activation's compiled MLX graph, so the values are
// that graph's on the CPU bit for bit.
class SiluGluCPU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder(inputs, out);
    const mx::array g = inputs[0], u = inputs[1];
    enc.dispatch([g, u, out]() mutable {
      const int64_t F = out.shape(-1), rows = F ? int64_t(out.size()) / F : 0;
      const int64_t sg = g.strides().back(), su = u.strides().back();
      const float* gp = g.data<float>();
      const float* up = u.data<float>();
      float* yp = out.data<float>();
      for (int64_t r = 0; r < rows; ++r) {
        const float* gr = gp + row_offset(g, r);
        const float* ur = up + row_offset(u, r);
        float* yr = yp + r * F;
        if (sg == 1 && su == 1) {
          for (int64_t i = 0; i < F; ++i) yr[i] = (gr[i] * mlx_sigmoid(gr[i])) * ur[i];
        } else {
          for (int64_t i = 0; i < F; ++i)
            yr[i] = (gr[i * sg] * mlx_sigmoid(gr[i * sg])) * ur[i * su];
        }
      }
    });
  }

  const char* name() const override { return "SiluGluCPU"; }
};

// Softmax over the last axis of a float32 array (any strides), as MLX 0.32.4's CPU Softmax
// computes it for float32 (mlx/backend/cpu/softmax.cpp, one lane on x86): the maximum,
// exp(x - max) (mlx_exp), their sum in index order, then each times 1 / sum. The exps run
// vectorized, the sum stays sequential: MLX's values bit for bit, the exp ~24x faster.
class SoftmaxCPU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder(inputs, out);
    const mx::array x = inputs[0];
    enc.dispatch([x, out]() mutable {
      const int64_t M = out.shape(-1), rows = M ? int64_t(out.size()) / M : 0;
      const int64_t sx = x.strides().back();
      const float* xp = x.data<float>();
      float* yp = out.data<float>();
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + row_offset(x, r);
        float* yr = yp + r * M;
        if (sx != 1) {  // a strided row: copied into the output first, then read from there
          for (int64_t i = 0; i < M; ++i) yr[i] = xr[i * sx];
          xr = yr;
        }
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < M; ++i) m = std::max(xr[i], m);
        for (int64_t i = 0; i < M; ++i) yr[i] = mlx_exp(xr[i] - m);
        float sum = 0.0f;
        for (int64_t i = 0; i < M; ++i) sum += yr[i];
        const float inv = 1 / sum;
        for (int64_t i = 0; i < M; ++i) yr[i] = yr[i] * inv;
      }
    });
  }

  const char* name() const override { return "SoftmaxCPU"; }
};

// logsumexp over the last axis of a float32 array (any strides) -> (..., 1), as MLX 0.32.4's
// CPU LogSumExp computes it for float32 (mlx/backend/cpu/logsumexp.cpp, one lane on x86): the
// maximum, the sum of exp(x - max) (mlx_exp) in index order, log(sum) + max (the max itself
// where it is infinite). The exps run vectorized a chunk at a time, the sum stays sequential:
// MLX's values bit for bit. A sampler's log-probabilities over a 262,144-token vocabulary took
// 3.2 ms a token in MLX's scalar exp.
class LogSumExpCPU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = 1;
    return {s};
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = encoder(inputs, out);
    const mx::array x = inputs[0];
    enc.dispatch([x, out]() mutable {
      const int64_t M = x.shape(-1), rows = M ? int64_t(x.size()) / M : 0;
      const int64_t sx = x.strides().back();
      const float* xp = x.data<float>();
      float* yp = out.data<float>();
      constexpr int64_t C = 1024;  // exps a chunk, kept in L1
      float e[C];
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + row_offset(x, r);
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < M; ++i) m = std::max(xr[i * sx], m);
        float sum = 0.0f;
        for (int64_t c0 = 0; c0 < M; c0 += C) {
          const int64_t n = std::min(C, M - c0);
          const float* xc = xr + c0 * sx;
          if (sx == 1)
            for (int64_t i = 0; i < n; ++i) e[i] = mlx_exp(xc[i] - m);
          else
            for (int64_t i = 0; i < n; ++i) e[i] = mlx_exp(xc[i * sx] - m);
          for (int64_t i = 0; i < n; ++i) sum += e[i];
        }
        yp[r] = std::isinf(m) ? m : std::log(sum) + m;
      }
    });
  }

  const char* name() const override { return "LogSumExpCPU"; }
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

mx::array softmax_cpu(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("softmax_cpu: x must be float32 with at least one axis");
  return mx::array(x.shape(), mx::float32, std::make_shared<SoftmaxCPU>(cpu_stream()), {x});
}

mx::array logsumexp_cpu(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument("logsumexp_cpu: x must be float32 with a non-empty last axis");
  mx::Shape s = x.shape();
  s.back() = 1;
  return mx::array(s, mx::float32, std::make_shared<LogSumExpCPU>(cpu_stream()), {x});
}

mx::array silu_glu_cpu(const mx::array& gate, const mx::array& up) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.ndim() < 1 ||
      gate.shape() != up.shape())
    throw std::invalid_argument("silu_glu_cpu: gate and up must be float32 of one shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<SiluGluCPU>(cpu_stream()),
                   {gate, up});
}

mx::array rms_norm_cpu(const mx::array& x, const std::optional<mx::array>& w, float eps) {
  if (x.dtype() != mx::float32 || x.ndim() < 1)
    throw std::invalid_argument("rms_norm_cpu: x must be float32 with at least one axis");
  if (w && (w->dtype() != mx::float32 || w->ndim() != 1 || w->shape(0) != x.shape(-1)))
    throw std::invalid_argument("rms_norm_cpu: w must be float32 (D,) for x (..., D)");
  std::vector<mx::array> in{x};
  if (w) in.push_back(*w);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RMSNormCPU>(cpu_stream(), eps, bool(w)), std::move(in));
}

mx::array rope_cpu(const mx::array& x, const mx::array& offset, const mx::array& inv_freq,
                   int dims, float scale) {
  if (x.dtype() != mx::float32 || x.ndim() != 4)
    throw std::invalid_argument("rope_cpu: x must be float32 (B, H, L, D)");
  if (dims <= 0 || dims % 2 || dims > x.shape(3))
    throw std::invalid_argument("rope_cpu: dims must be even and at most D");
  if (inv_freq.dtype() != mx::float32 || inv_freq.ndim() != 1 || inv_freq.shape(0) != dims / 2)
    throw std::invalid_argument("rope_cpu: inv_freq must be float32 (dims / 2,)");
  const bool rows_ok = offset.ndim() >= 1 && (offset.shape(0) == 1 || offset.shape(0) == x.shape(0));
  if (!rows_ok || offset.ndim() > 2 || (offset.ndim() == 2 && offset.shape(1) != x.shape(2)))
    throw std::invalid_argument("rope_cpu: offset must be (1,), (B,), (1, L) or (B, L)");
  const mx::array off = offset.dtype() == mx::int32 ? offset : mx::astype(offset, mx::int32);
  return mx::array(x.shape(), mx::float32, std::make_shared<RopeCPU>(cpu_stream(), dims, scale),
                   {x, off, inv_freq});
}

}  // namespace

void register_fused_ops(nb::module_& m) {
  m.def("rms_norm_cpu", &rms_norm_cpu, nb::arg("x"), nb::arg("w").none(), nb::arg("eps"),
        "x (..., D) float32 -> x * rsqrt(mean(x^2) + eps) (* w), one op");
  m.def("rope_cpu", &rope_cpu, nb::arg("x"), nb::arg("offset"), nb::arg("inv_freq"),
        nb::arg("dims"), nb::arg("scale"),
        "x (B, H, L, D) float32: MLX's non-interleaved RoPE at offset (+ l) or per-token "
        "positions, one op");
  m.def("softmax_cpu", &softmax_cpu, nb::arg("x"),
        "x (..., M) float32 -> softmax over the last axis, MLX's CPU values, one op");
  m.def("logsumexp_cpu", &logsumexp_cpu, nb::arg("x"),
        "x (..., M) float32, any strides -> logsumexp over the last axis (..., 1), MLX's CPU "
        "values, one op");
  m.def("silu_glu_cpu", &silu_glu_cpu, nb::arg("gate"), nb::arg("up"),
        "gate, up (..., F) float32, any strides -> silu(gate) * up, MLX's CPU values, one op");
}
