// Every decoder layer of a quantized model in one call: the same kernels as the Python layer loop
// (rms_norm_rows, u4_mm / u8_mm, the bias add, attend_rows, silu_mul, the residual adds), called
// in the same order on the same inputs, so the output is bitwise the loop's. What it saves is the
// loop itself: ~8 Python-level calls a layer, each through several frames (QuantMatrix, the row
// plan, the int8dot wrappers), ~2.6 ms of a 27 ms 1-token forward of the Qwen 1.5B (BENCHMARKS.md).
//
// A LayerStack is built once per model from its weights (it holds references, not copies) and is
// shared by every request; what a forward needs of a request (its rows, cache, start, mask) comes
// with the call.
#include <torch/extension.h>

#include <cstdint>
#include <vector>

torch::Tensor int8dot_u4_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t k, int64_t block);
torch::Tensor int8dot_u8_mm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale, int64_t n,
                            int64_t k, int64_t block);
torch::Tensor attend_rows(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          torch::Tensor keys, torch::Tensor values, int64_t start, const torch::Tensor& mask,
                          int64_t hq, int64_t hkv);
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);

namespace {

// One packed matrix [out, in] (no padded columns) and its optional bias.
struct Matrix {
  torch::Tensor packed, scale, bias;  // scale: u8 only; bias: undefined where the layer has none
  int64_t out = 0, in = 0;
  bool u4 = true;

  torch::Tensor operator()(const torch::Tensor& x, int64_t block) const {
    torch::Tensor y = u4 ? int8dot_u4_mm(x, packed, out, in, block) : int8dot_u8_mm(x, packed, scale, out, in, block);
    return bias.defined() ? y + bias : y;  // quant_linear's `y + b`
  }
};

struct Layer {
  torch::Tensor ln1, ln2;
  Matrix qkv, o, gu, down;
};

Matrix matrix(const py::dict& m) {
  Matrix r;
  r.u4 = m["kind"].cast<std::string>() == "w4a8";
  r.packed = m["packed"].cast<torch::Tensor>();
  if (!r.u4) r.scale = m["scale"].cast<torch::Tensor>();
  if (!m["bias"].is_none()) r.bias = m["bias"].cast<torch::Tensor>();
  r.out = m["out"].cast<int64_t>();
  r.in = m["in"].cast<int64_t>();
  return r;
}

class LayerStack {
 public:
  // layers: one dict a layer {ln1, ln2, qkv, o, gu, down}, each matrix a dict {kind ("w4a8" or
  // "w8a8g"), packed, scale (w8a8g), bias (or None), out, in}.
  LayerStack(const py::list& layers, int64_t heads, int64_t kv_heads, double eps)
      : heads_(heads), kv_heads_(kv_heads), eps_(eps) {
    for (const auto& item : layers) {
      const py::dict l = item.cast<py::dict>();
      layers_.push_back({l["ln1"].cast<torch::Tensor>(), l["ln2"].cast<torch::Tensor>(), matrix(l["qkv"]),
                         matrix(l["o"]), matrix(l["gu"]), matrix(l["down"])});
    }
  }

  // x float32 [n, hidden], the rows of every sequence; cos/sin [n, head_dim] at the rows'
  // positions. Sequence s owns rows [lo[s], hi[s]) and its cache keys[s]/values[s] [layers, 1,
  // kv_heads, capacity, head_dim], written at start[s]; masks[s] as attend_rows takes it.
  // Returns the last layer's output, float32 [n, hidden].
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                        const std::vector<int64_t>& start, const std::vector<int64_t>& lo,
                        const std::vector<int64_t>& hi, const std::vector<torch::Tensor>& masks, int64_t block) const {
    const size_t seqs = keys.size();
    TORCH_CHECK(values.size() == seqs && start.size() == seqs && lo.size() == seqs && hi.size() == seqs &&
                    masks.size() == seqs && seqs > 0,
                "LayerStack: one cache, start, row range and mask per sequence");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const torch::Tensor qkv = l.qkv(rms_norm_rows(x, l.ln1, eps_), block);
      std::vector<torch::Tensor> outs;
      for (size_t s = 0; s < seqs; ++s) {
        const int64_t n = hi[s] - lo[s];
        outs.push_back(attend_rows(qkv.narrow(0, lo[s], n), cos.narrow(0, lo[s], n), sin.narrow(0, lo[s], n),
                                   keys[s].select(0, i).select(0, 0), values[s].select(0, i).select(0, 0), start[s],
                                   masks[s], heads_, kv_heads_));
      }
      x = x + l.o(seqs == 1 ? outs[0] : torch::cat(outs), block);
      x = x + l.down(silu_mul(l.gu(rms_norm_rows(x, l.ln2, eps_), block)), block);
    }
    return x;
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_;
  double eps_;
};

}  // namespace

void register_layer_stack(py::module& m) {
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<const py::list&, int64_t, int64_t, double>())
      .def("forward", &LayerStack::forward, "every layer over the rows of every sequence -> the last layer's output")
      .def("__len__", &LayerStack::size);
}
