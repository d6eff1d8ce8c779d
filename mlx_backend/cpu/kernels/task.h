// Running a primitive's work as a task of the CPU stream's encoder.
#pragma once

#include <utility>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

namespace qmm {

// Allocates the outputs, registers them and the inputs with the stream's encoder,
// and queues fn(inputs, outputs): the inputs' contents are ready only when the
// task runs (earlier tasks on the stream compute them), so whatever reads them is
// in fn.
template <typename Fn>
void dispatch_task(
    mlx::core::Stream stream,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    Fn fn) {
  namespace mx = mlx::core;
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in, out;
  for (auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& a : outputs) {
    a.set_data(mx::allocator::malloc(a.nbytes()));
    encoder.set_output_array(a);
    out.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.dispatch([in = std::move(in), out = std::move(out), fn = std::move(fn)](
                       ) mutable { fn(in, out); });
}

// The same for a primitive with one output: fn(inputs, output).
template <typename Fn>
void dispatch_task(
    mlx::core::Stream stream,
    const std::vector<mlx::core::array>& inputs,
    mlx::core::array& output,
    Fn fn) {
  std::vector<mlx::core::array> outputs = {output};
  dispatch_task(
      stream,
      inputs,
      outputs,
      [fn = std::move(fn)](auto& in, auto& out) mutable { fn(in, out[0]); });
}

} // namespace qmm
