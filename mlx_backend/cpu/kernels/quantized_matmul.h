// The MLX primitive and op over the kernels in qmm.h.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "qmm.h"

namespace qmm {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases).T, evaluated on the CPU by this library.
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// [x @ dequantize(w_i, scales_i, biases_i).T for each i]: projections that share
// x (q, k and v; gate and up) as one node, x prepared once and the threads run
// once for all of them.
std::vector<mx::array> quantized_matmuls(
    const mx::array& x,
    const std::vector<mx::array>& ws,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// dequantize(w, scales, biases)[indices] as float32 [*indices.shape, K]: a
// quantized embedding's lookup as one node.
mx::array quantized_rows(
    const mx::array& indices,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

class QuantizedRows : public mx::UnaryPrimitive {
 public:
  // Inputs: the indices (int32 or uint32), then w, scales and biases.
  QuantizedRows(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CpuQuantizedRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.push_back(inputs[1].shape(1) * 32 / bits_);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
};

// One node for x @ dequantize(w_i, scales_i, biases_i).T, one output per weight.
class QuantizedMatmul : public mx::Primitive {
 public:
  // Inputs: x, then each weight's w, scales and biases.
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;

  const char* name() const override {
    return "CpuQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
};

// What runs the kernels: the instruction set and thread count, and the most rows
// of x that the row kernel takes before tiles of dequantized weights go to sgemm.
struct Settings {
  std::string isa;
  int threads;
  int rows_limit;
  bool sgemm;
  // What the row kernels multiply the weights with: float32 x, or x rounded per
  // group to int16, or to int8 (llama.cpp's way); and what rows of x past
  // rows_limit meet them as (int8: the GEMM; float32: sgemm tiles).
  std::string activations;
  std::string prefill_activations;
};

Settings settings();
void set_threads(int threads);

// Runs the worker pool `runs` times over tasks that count their calls: the number
// of tasks run other than once, or still running when their run returned.
int check_pool(int runs);
// GB/s the kernels' threads read `megabytes` of memory at (the best of `repeats`):
// the ceiling a decode step's products stream their weights against.
double read_bandwidth(int megabytes, int repeats);
// What x meets the weights as, up to rows_limit rows and past it ("": the same).
void set_activations(const std::string& activations, const std::string& prefill);
// Whether many rows of x go to the process's sgemm in tiles of dequantized weights
// (worth it with a fast BLAS), or to the row kernel in blocks of rows_limit rows.
void use_sgemm(bool use);
// Pick the kernels: "auto" (the best this CPU runs) or one of isas().
void set_isa(const std::string& isa);
// The kernels' instruction sets this CPU runs, best first (avx512vnni, avxvnni:
// the int8 kernels' dot products; avx2; portable).
std::vector<std::string> isas();

// Calls fn(i) for i in [0, tasks) on the kernels' threads, on several of them
// where the work (in multiply-adds) is large enough to pay for waking them.
void run_tasks(int tasks, double work, const std::function<void(int)>& fn);

// For primitives that run products inside their own task (decode_layer.cpp):
// a check that dequantize(w, scales, biases) is a weight the kernels take (its
// number of rows), `a`'s data (a row-major copy kept in `copies` where it is
// strided), x [M, K] @ dequantize(w).T into y, the weight read as row_major
// reads it (`copies` must outlive the products) ...
int check_weight(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits);
const void* row_major(
    const mx::array& a,
    std::vector<std::shared_ptr<std::vector<char>>>& copies);
Problem product(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    const float* x,
    int M,
    float* y,
    std::vector<std::shared_ptr<std::vector<char>>>& copies);
// ... and products of one x, run as one QuantizedMatmul node runs them.
void run_products(std::vector<Problem>& ps);

} // namespace qmm
