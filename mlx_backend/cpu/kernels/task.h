// Running a primitive's work as a task of the CPU stream's encoder.
#pragma once

#include <utility>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

namespace qmm {

// Allocates `out`, registers it and the inputs with the stream's encoder, and
// queues fn(inputs, out): the inputs' contents are ready only when the task runs
// (earlier tasks on the stream compute them), so whatever reads them is in fn.
template <typename Fn>
void dispatch_task(
    mlx::core::Stream stream,
    const std::vector<mlx::core::array>& inputs,
    mlx::core::array& out,
    Fn fn) {
  namespace mx = mlx::core;
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> in;
  for (auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.set_output_array(out);
  encoder.dispatch([in = std::move(in),
                    out = mx::array::unsafe_weak_copy(out),
                    fn = std::move(fn)]() mutable { fn(in, out); });
}

} // namespace qmm
