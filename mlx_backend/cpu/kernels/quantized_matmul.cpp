#include "quantized_matmul.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "qmm.h"
#include "task.h"

namespace qmm {

namespace {

// The fewest output rows a task takes, and the tasks per thread: few enough that
// claiming them (a cache line that moves between cores) costs little, enough to
// balance the threads.
constexpr int ROWS_PER_TASK = 16;
constexpr int TASKS_PER_THREAD = 4;
// Weight rows dequantized per sgemm call (for many rows of x).
constexpr int TILE_ROWS = 256;
// x's values per int8 scale in the GEMM from GEMM_X8_ROWS rows on (a prompt's
// chunk, a batch of 8 or more). Over 2,048 tokens read in chunks of 256, per 8
// gave a mean KL of 0.0008 from float32 and a perplexity -0.06% off, per 32
// (llama.cpp's q8_1) 0.0028 and +0.35%, for 6-12% more speed (per 4, the row
// kernels' rounding, prefilled at 0.6-0.8x per 32's speed). A batch's 8 to 32
// rows took 0.74-0.93x per 4's time.
constexpr int GEMM_X_BLOCK = 8;
constexpr int GEMM_X8_ROWS = 8;
// Rows of x from which int8 products take the GEMM, whose panels cost about one
// row kernel pass over the weights (x rounded per 4 values as the row kernels
// round it, per 8 from GEMM_X8_ROWS). On the default model's shapes it
// took 1.23-1.40x the int8 row kernels' time at 2 rows, 0.93-0.95x at 4,
// 0.57-0.73x at 8 and 0.53-0.61x at 16.
constexpr int GEMM_ROWS = 4;

using Sgemm = void (*)(
    int, int, int, int, int, int, float, const float*, int, const float*, int,
    float, float*, int);
constexpr int ROW_MAJOR = 101;
constexpr int NO_TRANS = 111;
constexpr int TRANS = 112;

// The process's cblas_sgemm: the preloaded fast BLAS, else the one MLX links.
Sgemm find_sgemm() {
  return reinterpret_cast<Sgemm>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
}

double env_number(const char* name, double fallback) {
  const char* value = std::getenv(name);
  return value ? std::atof(value) : fallback;
}

int spin_microseconds() {
  return int(env_number("MLX_BACKEND_KERNEL_SPIN_US", 20));
}

// A pool of workers that spin briefly between jobs (a decode step runs hundreds of
// matmuls back to back), then sleep. The caller takes tasks too and waits only for
// tasks a worker has claimed: a worker still waking up (a halted vCPU can take
// milliseconds) never holds a matmul back.
class Pool {
 public:
  ~Pool() {
    resize(1);
  }

  int size() const {
    return int(workers_.size()) + 1;
  }

  void resize(int threads) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      generation_++;
    }
    wake_.notify_all();
    for (auto& t : workers_) {
      t.join();
    }
    workers_.clear();
    stopping_ = false;
    // A worker waits for the generation after the one it starts in.
    long start = generation_.load();
    for (int i = 1; i < threads; i++) {
      workers_.emplace_back([this, start] { work(start); });
    }
  }

  // Calls fn(i) for i in [0, tasks), on the workers and the calling thread.
  void run(int tasks, const std::function<void(int)>& fn, bool parallel = true) {
    if (workers_.empty() || tasks <= 1 || !parallel) {
      for (int i = 0; i < tasks; i++) {
        fn(i);
      }
      return;
    }
    if (uint64_t(tasks) > TASK_MASK) {
      for (int base = 0; base < tasks; base += int(TASK_MASK)) {
        int part = std::min(tasks - base, int(TASK_MASK));
        run(part, [&](int i) { fn(base + i); });
      }
      return;
    }
    job_ = &fn;
    done_.store(0);
    // The claim names the run and its task count: a worker late for the last
    // run, whose claim is stale, can neither take a task of this one nor read
    // this run's count against that claim (it did: a task of this run ran twice,
    // the count of tasks done ran ahead, and this call returned while one still
    // read its frame).
    uint64_t run = ++runs_ & RUN_MASK;
    claims_.store(run << (2 * TASK_BITS) | uint64_t(tasks) << TASK_BITS);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_++;
    }
    wake_.notify_all();
    take_tasks();
    while (done_.load(std::memory_order_acquire) < tasks) {
      pause();
    }
  }

 private:
  // A claim: (run << 2 * TASK_BITS) | (tasks << TASK_BITS) | next task.
  static constexpr int TASK_BITS = 20;
  static constexpr uint64_t TASK_MASK = (uint64_t(1) << TASK_BITS) - 1;
  static constexpr uint64_t RUN_MASK = (uint64_t(1) << (64 - 2 * TASK_BITS)) - 1;

  static void pause() {
    // No PAUSE: under KVM, pause loops exit to the hypervisor.
    asm volatile("" ::: "memory");
  }

  void take_tasks() {
    uint64_t claim = claims_.load();
    while (true) {
      int task = int(claim & TASK_MASK);
      if (task >= int((claim >> TASK_BITS) & TASK_MASK)) {
        return;
      }
      if (claims_.compare_exchange_weak(claim, claim + 1)) {
        (*job_)(task);
        done_.fetch_add(1, std::memory_order_release);
        claim = claims_.load();
      }
    }
  }

  void work(long seen) {
    while (true) {
      // Spin briefly (the next matmul of a step comes within microseconds), then
      // sleep, leaving the core to the thread that builds the next step.
      auto until = std::chrono::steady_clock::now() + spin_;
      for (int spin = 0; generation_.load() == seen; spin++) {
        if (spin % 64 == 63 && std::chrono::steady_clock::now() > until) {
          break;
        }
      }
      if (generation_.load() == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load();
      if (stopping_) {
        return;
      }
      take_tasks();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<long> generation_{0};
  std::atomic<uint64_t> claims_{0};
  std::atomic<int> done_{0};
  uint64_t runs_ = 0;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<bool> stopping_{false};
  std::chrono::microseconds spin_{spin_microseconds()};
};

struct Kernels {
  std::string isa;
  RowsKernel rows;
  DequantizeKernel dequantize;
  // The row kernels on x rounded to int16 per group and to int8 per 4 values
  // (nullptr: none for this instruction set).
  RowsKernel rows_int16 = nullptr;
  RowsKernel rows_int8 = nullptr;
  // The int8 GEMM for many rows of x (nullptr: none; they take sgemm tiles).
  RowsKernel gemm_int8 = nullptr;
  QuantizeKernel quantize_int8 = qmm::quantize_int8;
  // Whether `rows` reads x in lane order (Problem::xl).
  bool rows_read_lanes = false;
  // Whether 8-bit weights take rows_int8 too: AVX2's has to recentre their codes
  // (maddubs saturates), and a decode row took 1.29x the float32 kernel's time.
  bool int8_for_8bit = true;
};

// The portable C++ kernels: any CPU, and any shape the kernels take.
Kernels portable_kernels() {
#if defined(__aarch64__)
  std::string name = "portable (neon)";
#else
  std::string name = "portable";
#endif
  // The portable int8 kernel takes x with either block of scales: it is the GEMM
  // too (the reference the vector ones are tested against).
  return {
      name,
      rows_portable,
      dequantize_portable,
      nullptr,
      rows_portable_int8,
      rows_portable_int8,
      quantize_int8};
}

// The kernels this CPU runs, best first: the float kernels are AVX2's wherever
// it has AVX2, the int8 ones each instruction set's own dot product.
std::vector<Kernels> cpu_kernels() {
  std::vector<Kernels> out;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    Kernels avx2{
        "avx2",          rows_avx2,         dequantize_avx2, rows_avx2_int16,
        rows_avx2_int8,  gemm_avx2_int8,    quantize_int8_avx2, true, false};
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) {
      Kernels vnni = avx2;
      vnni.isa = "avx512vnni";
      vnni.rows_int8 = rows_avx512vnni_int8;
      vnni.gemm_int8 = gemm_avx512vnni_int8;
      vnni.int8_for_8bit = true;
      out.push_back(vnni);
    }
    if (__builtin_cpu_supports("avxvnni")) {
      Kernels vnni = avx2;
      vnni.isa = "avxvnni";
      vnni.rows_int8 = rows_avxvnni_int8;
      vnni.gemm_int8 = gemm_avxvnni_int8;
      vnni.int8_for_8bit = true;
      out.push_back(vnni);
    }
    out.push_back(avx2);
  }
#endif
  out.push_back(portable_kernels());
  return out;
}

Kernels best_kernels() {
  return cpu_kernels().front();
}

struct State {
  Kernels kernels = best_kernels();
  Pool pool;
  int rows_limit = 32;
  // What x meets the weights as, up to rows_limit rows (the row kernels) and past
  // it (the int8 GEMM, or sgemm tiles). float32: the same logprobs whichever
  // kernel a row meets, so alone, batched and scored agree (cpu-kernels.md).
  std::string activations = "float32";
  std::string prefill_activations = "float32";
  // Multiply-adds from which a row-kernel matmul is split over the threads.
  double parallel_work = env_number("MLX_BACKEND_KERNEL_PARALLEL_WORK", 1 << 18);
  Sgemm sgemm = find_sgemm();
  std::mutex mutex;
};

State& state() {
  static State* s = [] {
    auto* created = new State();
    created->pool.resize(int(std::max(1u, std::thread::hardware_concurrency())));
    return created;
  }();
  return *s;
}

bool simd_shape(const Problem& p) {
  bool power_of_two = (p.group_size & (p.group_size - 1)) == 0;
  return (p.bits == 4 || p.bits == 8) && p.group_size % 32 == 0 && power_of_two;
}

void group_sums(Problem& p, std::vector<float>& xsum) {
  int groups = p.K / p.group_size;
  xsum.resize(size_t(p.M) * groups);
  for (int m = 0; m < p.M; m++) {
    const float* x = p.x + size_t(m) * p.K;
    for (int g = 0; g < groups; g++) {
      float total = 0.0f;
      for (int k = g * p.group_size; k < (g + 1) * p.group_size; k++) {
        total += x[k];
      }
      xsum[size_t(m) * groups + g] = total;
    }
  }
  p.xsum = xsum.data();
}

// y = x @ w.T for many rows of x: a tile of weight rows at a time dequantized for
// the BLAS's sgemm. On this thread alone: the BLAS's own threads stay busy
// (spinning) between its calls, and dequantizing is a small share of the tile's
// time.
void compute_tiles(const Problem& p, const Kernels& k) {
  State& s = state();
  thread_local std::vector<float> tile;
  tile.resize(size_t(TILE_ROWS) * p.K);
  for (int t0 = 0; t0 < p.N; t0 += TILE_ROWS) {
    int t1 = std::min(p.N, t0 + TILE_ROWS);
    k.dequantize(p, t0, t1, tile.data());
    s.sgemm(
        ROW_MAJOR, NO_TRANS, TRANS, p.M, t1 - t0, p.K, 1.0f, p.x, p.K,
        tile.data(), p.K, 0.0f, p.y + t0, p.N);
  }
}

// x quantized for the int8 kernels: a prompt's rows split over the threads.
void quantize_x(
    const Problem& p,
    QuantizeKernel quantize,
    int8_t* xq,
    float* xd,
    float* xsum) {
  State& s = state();
  int tasks = std::min(p.M, 2 * s.pool.size());
  bool parallel = double(p.M) * p.K >= s.parallel_work;
  s.pool.run(
      tasks,
      [&](int t) {
        quantize(p, p.M * t / tasks, p.M * (t + 1) / tasks, xq, xd, xsum);
      },
      parallel);
}

// Rows m0..m0 + count of p (as far as p goes), whose quantized x takes
// `xq_bytes` a value and `xd_row` scales a row.
Problem rows_block(
    const Problem& p,
    int m0,
    int count,
    size_t xq_bytes,
    size_t xd_row) {
  if (m0 == 0 && p.M <= count) {
    return p;
  }
  int groups = p.K / p.group_size;
  Problem b = p;
  b.M = std::min(count, p.M - m0);
  b.x = p.x + size_t(m0) * p.K;
  b.xsum = p.xsum + size_t(m0) * groups;
  b.xd = p.xd + size_t(m0) * xd_row;
  if (p.xq != nullptr) {
    b.xq = static_cast<const char*>(p.xq) + size_t(m0) * p.K * xq_bytes;
  }
  if (p.xl != nullptr) {
    b.xl = p.xl + size_t(m0) * p.K;
  }
  b.y = p.y + size_t(m0) * p.N;
  return b;
}

// y_i = x @ w_i.T for problems that share x (the same rows, inputs, bits and
// group size): x is prepared once, and the threads run once for all of them.
void compute(std::vector<Problem>& ps) {
  State& s = state();
  Problem& first = ps[0];
  Kernels k = simd_shape(first) ? s.kernels : portable_kernels();
  bool many = first.M > s.rows_limit;
  const std::string& activations = many ? s.prefill_activations : s.activations;
  bool int8 = activations == "int8" && k.rows_int8 != nullptr &&
      (first.bits == 4 || (first.bits == 8 && k.int8_for_8bit));
  // Whether the int8 GEMM takes all of x's rows at once (it converts each weight
  // panel once for them): from GEMM_ROWS rows on, with x rounded as the row
  // kernels round it, and from GEMM_X8_ROWS with a scale per GEMM_X_BLOCK of x's
  // values.
  bool whole = int8 && first.M >= GEMM_ROWS && k.gemm_int8 != nullptr;
  if (many && !whole && s.sgemm != nullptr) {
    for (auto& p : ps) {
      compute_tiles(p, k);
    }
    return;
  }
  // The call's buffers, kept by the calling thread (the CPU stream's) between calls.
  thread_local std::vector<float> xsum, xd, xl;
  thread_local std::vector<int8_t> x8;
  thread_local std::vector<int16_t> x16;
  thread_local std::vector<std::array<int, 3>> spans;
  if (int8) {
    // quantize_int8 writes the sums of the rounded values.
    xsum.resize(size_t(first.M) * (first.K / first.group_size));
    first.xsum = xsum.data();
  } else {
    group_sums(first, xsum);
  }
  RowsKernel rows = k.rows;
  size_t xd_row = first.K / first.group_size;
  if (activations == "int16" && k.rows_int16 != nullptr) {
    xd.resize(size_t(first.M) * xd_row);
    x16.resize(size_t(first.M) * first.K);
    quantize_rows(first, first.bits == 4, x16.data(), xd.data());
    first.xq = x16.data();
    first.xd = xd.data();
    rows = k.rows_int16;
  } else if (int8) {
    // A scale per 4 values for the row kernels and the GEMM's first rows, per 8
    // for the GEMM from GEMM_X8_ROWS, and the groups' sums of the rounded values.
    first.x_block = whole && first.M >= GEMM_X8_ROWS ? GEMM_X_BLOCK : 4;
    xd_row = first.K / first.x_block;
    xd.resize(size_t(first.M) * xd_row);
    x8.resize(size_t(first.M) * first.K);
    quantize_x(first, k.quantize_int8, x8.data(), xd.data(), xsum.data());
    first.xq = x8.data();
    first.xd = xd.data();
    rows = whole ? k.gemm_int8 : k.rows_int8;
  }
  if (rows == k.rows && k.rows_read_lanes) {
    xl.resize(size_t(first.M) * first.K);
    lane_order(first, xl.data());
    first.xl = xl.data();
  }
  int outputs = 0;
  for (auto& p : ps) {
    p.xsum = first.xsum;
    p.xd = first.xd;
    p.xq = first.xq;
    p.xl = first.xl;
    p.x_block = first.x_block;
    outputs += p.N;
  }
  int per_task = std::max(
      ROWS_PER_TASK, (outputs + s.pool.size() * TASKS_PER_THREAD - 1) /
          (s.pool.size() * TASKS_PER_THREAD));
  // Whole weight panels (16 rows) for the GEMM, 8 rows for the row kernels.
  int align = whole ? 16 : 8;
  per_task = (per_task + align - 1) / align * align;
  // (problem, first output row, end) of each task.
  spans.clear();
  for (int i = 0; i < int(ps.size()); i++) {
    for (int n0 = 0; n0 < ps[i].N; n0 += per_task) {
      spans.push_back({i, n0, std::min(ps[i].N, n0 + per_task)});
    }
  }
  // A small matmul runs on this thread alone: waking a worker costs more than
  // it saves, and the other core builds the next step's graph meanwhile.
  bool parallel = double(first.M) * outputs * first.K >= s.parallel_work;
  size_t xq_bytes = rows == k.rows_int16 ? sizeof(int16_t) : sizeof(int8_t);
  // The workers reach the caller's spans through this (a thread_local named in
  // the lambda would be each worker's own).
  const std::array<int, 3>* task_spans = spans.data();
  s.pool.run(
      int(spans.size()),
      [&](int t) {
        auto [i, n0, n1] = task_spans[t];
        // Many rows (no fast sgemm) in blocks of rows_limit, so that a block of x
        // stays in cache while the task's weight rows meet it.
        int block = whole ? first.M : s.rows_limit;
        for (int m0 = 0; m0 < first.M; m0 += block) {
          rows(rows_block(ps[i], m0, block, xq_bytes, xd_row), n0, n1);
        }
      },
      parallel);
}

ScaleType scale_type(mx::Dtype dtype) {
  if (dtype == mx::float32) {
    return ScaleType::f32;
  }
  return dtype == mx::float16 ? ScaleType::f16 : ScaleType::bf16;
}

std::string shape_text(const mx::array& a) {
  std::ostringstream text;
  text << "(";
  for (int i = 0; i < a.ndim(); i++) {
    text << (i ? ", " : "") << a.shape(i);
  }
  text << (a.ndim() == 1 ? ",)" : ")");
  return text.str();
}

} // namespace

int check_weight(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits) {
  if (bits != 2 && bits != 4 && bits != 8) {
    throw std::invalid_argument("[quantized_matmul] bits must be 2, 4 or 8");
  }
  if (group_size < 32 || group_size % 32 != 0) {
    throw std::invalid_argument(
        "[quantized_matmul] group_size must be a multiple of 32");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) {
    throw std::invalid_argument(
        "[quantized_matmul] w must be a 2-D uint32 array, got " + shape_text(w));
  }
  int N = w.shape(0);
  int K = w.shape(1) * 32 / bits;
  if (K % group_size != 0) {
    throw std::invalid_argument(
        "[quantized_matmul] the inputs (" + std::to_string(K) +
        ") must be a multiple of group_size");
  }
  auto expected = mx::Shape{N, K / group_size};
  for (auto* a : {&scales, &biases}) {
    if (a->shape() != expected || !mx::issubdtype(a->dtype(), mx::floating)) {
      throw std::invalid_argument(
          "[quantized_matmul] scales and biases must be floating point of shape (" +
          std::to_string(N) + ", " + std::to_string(K / group_size) + "), got " +
          shape_text(*a));
    }
  }
  return N;
}

namespace {

// The same for x @ dequantize(w, scales, biases).T; its number of outputs.
int check_weight(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits) {
  int N = qmm::check_weight(w, scales, biases, group_size, bits);
  int K = w.shape(1) * 32 / bits;
  if (x.ndim() < 1 || x.shape(-1) != K) {
    throw std::invalid_argument(
        "[quantized_matmul] x's last axis must be " + std::to_string(K) +
        ", got " + shape_text(x));
  }
  return N;
}

// No op but the matmul where none is needed: each op costs microseconds to run
// on the CPU stream, and a decode step has hundreds of matmuls.
mx::array as(const mx::array& a, mx::Dtype dtype, mx::Stream stream) {
  return a.dtype() == dtype ? a : mx::astype(a, dtype, stream);
}

} // namespace

mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  return quantized_matmuls(x, {w}, {scales}, {biases}, group_size, bits, s)[0];
}

std::vector<mx::array> quantized_matmuls(
    const mx::array& x,
    const std::vector<mx::array>& ws,
    const std::vector<mx::array>& scales,
    const std::vector<mx::array>& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  if (ws.empty() || scales.size() != ws.size() || biases.size() != ws.size()) {
    throw std::invalid_argument(
        "[quantized_matmuls] give one or more weights, each with its scales and "
        "biases");
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {as(x, mx::float32, stream)};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < ws.size(); i++) {
    auto shape = x.shape();
    shape.back() = check_weight(x, ws[i], scales[i], biases[i], group_size, bits);
    shapes.push_back(shape);
    auto common = mx::promote_types(scales[i].dtype(), biases[i].dtype());
    inputs.push_back(ws[i]);
    inputs.push_back(as(scales[i], common, stream));
    inputs.push_back(as(biases[i], common, stream));
  }
  auto ys = mx::array::make_arrays(
      shapes,
      std::vector<mx::Dtype>(ws.size(), mx::float32),
      std::make_shared<QuantizedMatmul>(stream, group_size, bits),
      inputs);
  if (mx::issubdtype(x.dtype(), mx::floating)) {
    for (auto& y : ys) {
      y = as(y, x.dtype(), stream);
    }
  }
  return ys;
}

namespace {

// `a`'s elements in row-major order (for an input that isn't).
std::shared_ptr<std::vector<char>> row_major_copy(const mx::array& a) {
  size_t item = a.itemsize();
  auto copy = std::make_shared<std::vector<char>>(a.size() * item);
  const char* base = a.data<char>();
  for (size_t i = 0; i < a.size(); i++) {
    int64_t offset = 0;
    size_t rest = i;
    for (int axis = a.ndim() - 1; axis >= 0; axis--) {
      offset += int64_t(rest % a.shape(axis)) * a.strides(axis);
      rest /= a.shape(axis);
    }
    std::memcpy(copy->data() + i * item, base + offset * int64_t(item), item);
  }
  return copy;
}

} // namespace

const void* row_major(
    const mx::array& a,
    std::vector<std::shared_ptr<std::vector<char>>>& copies) {
  if (a.flags().row_contiguous) {
    return a.data<void>();
  }
  copies.push_back(row_major_copy(a));
  return copies.back()->data();
}

namespace {

// The weight's part of a problem (no x or y yet).
Problem weight_problem(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    std::vector<std::shared_ptr<std::vector<char>>>& copies) {
  Problem p;
  p.x = nullptr;
  p.xsum = nullptr;
  p.xq = nullptr;
  p.xd = nullptr;
  p.x_block = 4;
  p.xl = nullptr;
  p.w = static_cast<const uint32_t*>(row_major(w, copies));
  p.scales = row_major(scales, copies);
  p.biases = row_major(biases, copies);
  p.y = nullptr;
  p.M = 0;
  p.N = w.shape(0);
  p.K = w.shape(1) * 32 / bits;
  p.bits = bits;
  p.group_size = group_size;
  p.scale_type = scale_type(scales.dtype());
  return p;
}

// The problem of x @ dequantize(w).T into y.
Problem problem(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    mx::array& y,
    int group_size,
    int bits,
    std::vector<std::shared_ptr<std::vector<char>>>& copies) {
  auto rows = static_cast<const float*>(row_major(x, copies));
  Problem p =
      product(w, scales, biases, group_size, bits, rows, 0, y.data<float>(), copies);
  p.M = int(x.size() / p.K);
  return p;
}

} // namespace

void QuantizedMatmul::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  dispatch_task(stream(), inputs, outputs, [group_size = group_size_, bits = bits_](
                                               std::vector<mx::array>& in,
                                               std::vector<mx::array>& out) {
    std::vector<std::shared_ptr<std::vector<char>>> copies;
    std::vector<Problem> ps;
    for (size_t i = 0; i < out.size(); i++) {
      ps.push_back(problem(
          in[0],
          in[1 + 3 * i],
          in[2 + 3 * i],
          in[3 + 3 * i],
          out[i],
          group_size,
          bits,
          copies));
    }
    std::lock_guard<std::mutex> lock(state().mutex);
    compute(ps);
  });
}

mx::array quantized_rows(
    const mx::array& indices,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  check_weight(w, scales, biases, group_size, bits);
  if (indices.dtype() != mx::int32 && indices.dtype() != mx::uint32) {
    throw std::invalid_argument("[quantized_rows] indices must be int32 or uint32");
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  auto shape = indices.shape();
  shape.push_back(w.shape(1) * 32 / bits);
  auto common = mx::promote_types(scales.dtype(), biases.dtype());
  return mx::array(
      shape,
      mx::float32,
      std::make_shared<QuantizedRows>(stream, group_size, bits),
      {indices, w, as(scales, common, stream), as(biases, common, stream)});
}

void QuantizedRows::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  dispatch_task(stream(), inputs, out, [group_size = group_size_, bits = bits_](
                                           std::vector<mx::array>& in,
                                           mx::array& y) {
    std::vector<std::shared_ptr<std::vector<char>>> copies;
    Problem p = weight_problem(in[1], in[2], in[3], group_size, bits, copies);
    p.y = y.data<float>();
    auto index = static_cast<const uint32_t*>(row_major(in[0], copies));
    bool is_signed = in[0].dtype() == mx::int32;
    std::lock_guard<std::mutex> lock(state().mutex);
    Kernels k = simd_shape(p) ? state().kernels : portable_kernels();
    for (size_t i = 0; i < in[0].size(); i++) {
      int64_t row = is_signed ? int64_t(int32_t(index[i])) : int64_t(index[i]);
      float* dst = p.y + i * size_t(p.K);
      // A row outside the table is zeros (MLX's take reads what is there).
      if (row < 0 || row >= p.N) {
        std::fill(dst, dst + p.K, 0.0f);
      } else {
        k.dequantize(p, int(row), int(row) + 1, dst);
      }
    }
  });
}

void QuantizedRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[quantized_rows] runs on the CPU only");
}

bool QuantizedRows::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedRows&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

void QuantizedMatmul::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  throw std::runtime_error("[quantized_matmul] runs on the CPU only");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(
    const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (size_t i = 1; i < inputs.size(); i += 3) {
    auto shape = inputs[0].shape();
    shape.back() = inputs[i].shape(0);
    shapes.push_back(shape);
  }
  return shapes;
}

// What rows of x meet the weights as under `activations`, with the kernels k:
// the setting where they have its kernel, else float32.
std::string effective(const State& s, const std::string& activations, bool many) {
  const Kernels& k = s.kernels;
  // (8-bit weights on AVX2 stay on float32: this names what 4-bit ones meet.)
  if (activations == "int8" && k.rows_int8 != nullptr &&
      (!many || k.gemm_int8 != nullptr || s.sgemm == nullptr)) {
    return "int8";
  }
  if (activations == "int16" && k.rows_int16 != nullptr &&
      (!many || s.sgemm == nullptr)) {
    return "int16";
  }
  return "float32";
}

Settings settings() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return {
      s.kernels.isa,
      s.pool.size(),
      s.rows_limit,
      s.sgemm != nullptr,
      effective(s, s.activations, false),
      effective(s, s.prefill_activations, true)};
}

void set_activations(const std::string& activations, const std::string& prefill) {
  auto known = [](const std::string& a) {
    return a == "float32" || a == "int16" || a == "int8";
  };
  if (!known(activations) || !(prefill.empty() || known(prefill))) {
    throw std::invalid_argument(
        "[quantized_matmul] activations must be float32, int16 or int8");
  }
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.activations = activations;
  s.prefill_activations = prefill.empty() ? activations : prefill;
}

Problem product(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    const float* x,
    int M,
    float* y,
    std::vector<std::shared_ptr<std::vector<char>>>& copies) {
  Problem p = weight_problem(w, scales, biases, group_size, bits, copies);
  p.x = x;
  p.y = y;
  p.M = M;
  return p;
}

void run_products(std::vector<Problem>& ps) {
  std::lock_guard<std::mutex> lock(state().mutex);
  compute(ps);
}

void run_tasks(int tasks, double work, const std::function<void(int)>& fn) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.pool.run(tasks, fn, work >= s.parallel_work);
}

int check_pool(int runs) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  constexpr int MOST_TASKS = 40;
  std::vector<std::atomic<int>> taken(MOST_TASKS);
  std::atomic<int> running{0}, faults{0};
  for (int r = 0; r < runs; r++) {
    // Runs of many tasks and of few alternate: a worker late for one run meets
    // the next with another task count.
    int tasks = r % 2 ? MOST_TASKS - r % 7 : 2 + r % 3;
    for (auto& t : taken) {
      t.store(0);
    }
    s.pool.run(tasks, [&](int t) {
      running.fetch_add(1);
      if (t < 0 || t >= tasks) {
        faults.fetch_add(1);
      } else {
        taken[t].fetch_add(1);
      }
      volatile int spin = 0;
      for (int i = 0; i < 50 + t % 5 * 40; i++) {
        spin = spin + i;
      }
      running.fetch_sub(1);
    });
    // Every task ran once, and none still runs once the run returns.
    faults += running.load() != 0;
    for (int t = 0; t < MOST_TASKS; t++) {
      faults += taken[t].load() != (t < tasks ? 1 : 0);
    }
  }
  return faults.load();
}

double read_bandwidth(int megabytes, int repeats) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<uint64_t> buffer(size_t(megabytes) << 17, 1);
  // Many slices, so that a thread late to wake leaves its share to the others.
  constexpr int SLICES = 64;
  std::array<uint64_t, SLICES * 8> sums{};
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < repeats; r++) {
    auto start = std::chrono::steady_clock::now();
    s.pool.run(SLICES, [&](int t) {
      size_t from = buffer.size() * t / SLICES, to = buffer.size() * (t + 1) / SLICES;
      uint64_t lanes[8] = {};
      for (size_t i = from; i + 8 <= to; i += 8) {
        for (int l = 0; l < 8; l++) {
          lanes[l] += buffer[i + l];
        }
      }
      for (int l = 0; l < 8; l++) {
        sums[t * 8 + l] = lanes[l];
      }
    });
    std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count());
  }
  uint64_t total = 0;
  for (uint64_t v : sums) {
    total += v;
  }
  // Each word is 1: a sum short of the words means a slice went unread.
  if (total != buffer.size() / 8 * 8) {
    throw std::logic_error("[read_bandwidth] a slice went unread");
  }
  return double(buffer.size()) * 8 / best / 1e9;
}

void set_threads(int threads) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.pool.resize(std::max(1, threads));
}

void use_sgemm(bool use) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.sgemm = use ? find_sgemm() : nullptr;
}

void set_isa(const std::string& isa) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::string names;
  for (const Kernels& k : cpu_kernels()) {
    if (isa == "auto" || isa == k.isa) {
      s.kernels = k;
      return;
    }
    names += ", " + k.isa;
  }
  throw std::invalid_argument("[quantized_matmul] isa must be auto" + names);
}

std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (const Kernels& k : cpu_kernels()) {
    out.push_back(k.isa);
  }
  return out;
}

} // namespace qmm
