// CPU primitives for the per-token ops around the mat-vecs (eval_cpu only): the RMS norm and the
// non-interleaved RoPE, one graph op each. MLX 0.32.4's CPU back end has no kernel for
// mx.fast.rms_norm or mx.fast.rope and runs their fallbacks, 4-5 and ~10 ops per call: a
// SmolLM2-135M decode step was 2,209 ops, ~900 of them these two (each op ~4 us of dispatch on
// a 2-core machine). float32 only (the CPU path's dtype); any strides in, contiguous out.

#include <cmath>
#include <cstdint>
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

namespace {

// Offset (in elements) of the first element of row r of x, a row being the last axis.
int64_t row_offset(const mx::array& x, int64_t r) {
  int64_t off = 0;
  for (int d = int(x.ndim()) - 2; d >= 0; --d) {
    const int64_t n = x.shape(d);
    off += (r % n) * int64_t(x.strides()[d]);
    r /= n;
  }
  return off;
}

// y = x * rsqrt(mean(x^2) + eps) (* w) over the last axis; the sum of squares in double, the
// rest in float, as transformers' fp32 RMSNorm up to the summation order.
class RMSNormCPU : public mx::UnaryPrimitive {
 public:
  RMSNormCPU(mx::Stream s, float eps, bool has_w) : mx::UnaryPrimitive(s), eps_(eps), w_(has_w) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
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

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("rms_norm_cpu runs on the CPU only");
  }

  const char* name() const override { return "RMSNormCPU"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNormCPU&>(other);
    return eps_ == o.eps_ && w_ == o.w_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  bool w_;
};

// Non-interleaved RoPE of x (B, H, L, D): pair i of the first `dims` channels (i, i + dims / 2)
// turns by theta = position * scale * inv_freq[i]; channels past dims are copied. offset, int32:
// (1,) or (B,) first positions (token l at offset_b + l), or (1 or B, L) a position per token.
class RopeCPU : public mx::UnaryPrimitive {
 public:
  RopeCPU(mx::Stream s, int dims, float scale) : mx::UnaryPrimitive(s), dims_(dims), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
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

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("rope_cpu runs on the CPU only");
  }

  const char* name() const override { return "RopeCPU"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeCPU&>(other);
    return dims_ == o.dims_ && scale_ == o.scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  float scale_;
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

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
}
