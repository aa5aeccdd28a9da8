// harness test device: PrivateUse1 renamed (to "hdev" by the Python package), memory on the host.
//
// What a PrivateUse1 backend must give PyTorch, and nothing more: an allocator (here counting
// allocated / peak bytes per device), a device guard, hooks (availability, generators), the
// tensor-creation, copy, resize and view kernels registered natively, and every other op through a
// boxed fallback that runs the CPU kernel on host copies and counts the op by name. Tests and
// `harness certify`-style fault injection register their own kernels for single ops on top.
#include <torch/extension.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr c10::DeviceType kDev = c10::DeviceType::PrivateUse1;

c10::DeviceIndex device_count_() {
  static const c10::DeviceIndex n = [] {
    const char* s = std::getenv("TESTDEV_DEVICES");
    int v = s ? std::atoi(s) : 2;
    return static_cast<c10::DeviceIndex>(std::clamp(v, 1, 16));
  }();
  return n;
}

thread_local c10::DeviceIndex g_current = 0;

void check_index(c10::DeviceIndex i) {
  TORCH_CHECK(i >= 0 && i < device_count_(), "hdev: device index ", static_cast<int>(i),
              " out of range (", static_cast<int>(device_count_()), " devices)");
}

// ---- allocator: host memory, counted per device ------------------------------------------------
struct Stats {
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t n_allocs = 0;
};
std::mutex g_mem_mutex;
std::vector<Stats> g_stats(16);
std::unordered_map<void*, std::pair<size_t, c10::DeviceIndex>> g_blocks;

void host_free(void* p) {
  if (!p) return;
  {
    std::lock_guard<std::mutex> lk(g_mem_mutex);
    auto it = g_blocks.find(p);
    if (it != g_blocks.end()) {
      g_stats[it->second.second].allocated -= static_cast<int64_t>(it->second.first);
      g_blocks.erase(it);
    }
  }
  c10::free_cpu(p);
}

struct HostCountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex idx = g_current;
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> lk(g_mem_mutex);
      g_blocks[p] = {n, idx};
      auto& s = g_stats[idx];
      s.allocated += static_cast<int64_t>(n);
      s.peak = std::max(s.peak, s.allocated);
      s.n_allocs += 1;
    }
    return {p, p, &host_free, c10::Device(kDev, idx)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &host_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
HostCountingAllocator g_alloc;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_alloc);

// ---- device guard ----------------------------------------------------------------------------
std::atomic<int64_t> g_syncs{0};

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDev; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kDev, g_current); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kDev, "hdev: not an hdev device: ", d);
    if (d.has_index()) {
      check_index(d.index());
      g_current = d.index();
    }
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) g_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  // streams exist (work is synchronous on the host, so every stream is always idle)
  c10::Stream getNewStream(c10::Device d, int) const override {
    static std::atomic<c10::StreamId> next{1};
    return c10::Stream(c10::Stream::UNSAFE, d, next++);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  bool queryStream(const c10::Stream&) const override { return true; }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count_(); }
  void synchronizeDevice(const c10::DeviceIndex) const override { g_syncs++; }
  void synchronizeStream(const c10::Stream&) const override { g_syncs++; }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---- generators: a CPU generator whose device is hdev ----------------------------------------
struct HGenerator final : at::CPUGeneratorImpl {
  explicit HGenerator(c10::DeviceIndex idx) {
    device_ = c10::Device(kDev, idx);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

std::mutex g_gen_mutex;
const at::Generator& default_generator(c10::DeviceIndex idx) {
  static std::vector<at::Generator> gens = [] {
    std::vector<at::Generator> v;
    for (c10::DeviceIndex i = 0; i < device_count_(); ++i) {
      v.push_back(at::make_generator<HGenerator>(i));
      v.back().set_current_seed(c10::detail::getNonDeterministicRandom());
    }
    return v;
  }();
  if (idx < 0) idx = g_current;
  check_index(idx);
  return gens[idx];
}

at::Generator new_generator(c10::DeviceIndex idx) {
  if (idx < 0) idx = g_current;
  check_index(idx);
  return at::make_generator<HGenerator>(idx);
}

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count_(); }
  c10::DeviceIndex getCurrentDevice() const override { return g_current; }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    g_current = d;
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex idx) const override { return default_generator(idx); }
  at::Generator getNewGenerator(c10::DeviceIndex idx) const override { return new_generator(idx); }
  at::Device getDeviceFromPtr(void* p) const override {
    std::lock_guard<std::mutex> lk(g_mem_mutex);
    auto it = g_blocks.find(p);
    return c10::Device(kDev, it == g_blocks.end() ? g_current : it->second.second);
  }
  // UntypedStorage.resize_ on the device (FSDP2 frees and re-allocates its unsharded parameters so),
  // as the CPU's resize_bytes: a new block on the storage's device, the common prefix copied.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "hdev: trying to resize a storage that is not resizable");
    const c10::DeviceGuard guard(impl->device());
    c10::DataPtr fresh = g_alloc.allocate(newsize);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep && impl->data()) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};
const bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

// ---- native kernels --------------------------------------------------------------------------
c10::DispatchKeySet dev_keys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device,
                               std::optional<bool>, std::optional<at::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, &g_alloc, dev_keys(), c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, &g_alloc, dev_keys(), c10::dtype_or_default(dtype));
}

// The device's memory is host memory: a CPU tensor aliasing it does every copy (dtype conversion,
// strides, broadcasting) with the CPU copy kernel.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() != kDev) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), at::TensorOptions().dtype(t.dtype()).device(at::kCPU));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  TORCH_CHECK(self.defined() && dst.defined(), "hdev: _copy_from of an undefined tensor");
  if (self.numel() == 0 || dst.numel() == 0) return dst;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  const c10::DeviceGuard guard(self.device());
  return at::native::resize_(self, size, fmt);
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// set_ rebinds a tensor to a storage: it must see the device tensor, never a host copy
at::Tensor& set_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, source, offset, size, stride);
}

at::Tensor unfold(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  return at::native::unfold(self, dim, size, step);
}

// histc with integer input, as CUDA's: transformers' MoE counts the tokens per expert with an int
// histc on every accelerator but CPU and MPS (integrations/moe.py), and the CPU kernel (which the
// fallback would run) rejects integers. Output in the input's dtype, like CUDA's.
at::Tensor histc(const at::Tensor& self, int64_t bins, const at::Scalar& min, const at::Scalar& max) {
  const c10::DeviceGuard guard(self.device());
  auto in = host_alias(self);
  auto h = at::histc(in.is_floating_point() ? in : in.to(at::kFloat), bins, min, max);
  auto out = at::empty(h.sizes(), self.options());
  host_alias(out).copy_(h);
  return out;
}

// ---- the boxed fallback: CPU kernels on host copies, counted per op --------------------------
std::mutex g_count_mutex;
std::map<std::string, int64_t> g_fallback_counts;

bool is_generator_arg(const c10::Argument& a) {
  const auto& t = a.type();
  if (t->kind() == c10::TypeKind::GeneratorType) return true;
  if (auto o = t->cast<c10::OptionalType>()) return o->getElementType()->kind() == c10::TypeKind::GeneratorType;
  return false;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  {
    std::lock_guard<std::mutex> lk(g_count_mutex);
    g_fallback_counts[c10::toString(schema.operator_name())] += 1;
  }
  // A random op draws from the hdev generator: its state goes through a CPU generator for the
  // CPU kernel and comes back advanced (a None generator means the device's default one).
  const auto n_args = schema.arguments().size();
  const auto base = stack->size() - n_args;
  int gen_slot = -1;
  c10::DeviceIndex dev_idx = g_current;
  for (size_t i = 0; i < n_args; ++i) {
    const auto& v = (*stack)[base + i];
    if (is_generator_arg(schema.arguments()[i])) gen_slot = static_cast<int>(i);
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kDev)
      dev_idx = v.toTensor().device().index();
  }
  if (gen_slot < 0) {
    at::native::cpu_fallback(op, stack);
    return;
  }
  auto& slot = (*stack)[base + gen_slot];
  at::Generator dev_gen;
  if (slot.isNone()) {
    dev_gen = default_generator(dev_idx);
  } else {
    auto g = slot.toGenerator();
    if (g.device().type() != kDev) {
      at::native::cpu_fallback(op, stack);
      return;
    }
    dev_gen = g;
  }
  std::lock_guard<std::mutex> lk(g_gen_mutex);
  std::lock_guard<std::mutex> glk(dev_gen.mutex());
  auto cpu_gen = at::make_generator<at::CPUGeneratorImpl>();
  cpu_gen.set_state(dev_gen.get_state());
  slot = c10::IValue(cpu_gen);
  at::native::cpu_fallback(op, stack);
  dev_gen.set_state(cpu_gen.get_state());
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", unfold);
  m.impl("histc", histc);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

// ---- the Python side ---------------------------------------------------------------------------
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("device_count", [] { return static_cast<int>(device_count_()); });
  m.def("current_device", [] { return static_cast<int>(g_current); });
  m.def("set_device", [](int i) {
    check_index(static_cast<c10::DeviceIndex>(i));
    g_current = static_cast<c10::DeviceIndex>(i);
  });
  m.def("synchronize", [](int) { g_syncs++; });
  m.def("synchronize_count", [] { return g_syncs.load(); });
  m.def("memory_allocated", [](int i) {
    check_index(static_cast<c10::DeviceIndex>(i));
    std::lock_guard<std::mutex> lk(g_mem_mutex);
    return g_stats[i].allocated;
  });
  m.def("max_memory_allocated", [](int i) {
    check_index(static_cast<c10::DeviceIndex>(i));
    std::lock_guard<std::mutex> lk(g_mem_mutex);
    return g_stats[i].peak;
  });
  m.def("allocation_count", [](int i) {
    check_index(static_cast<c10::DeviceIndex>(i));
    std::lock_guard<std::mutex> lk(g_mem_mutex);
    return g_stats[i].n_allocs;
  });
  m.def("reset_peak_memory_stats", [](int i) {
    check_index(static_cast<c10::DeviceIndex>(i));
    std::lock_guard<std::mutex> lk(g_mem_mutex);
    g_stats[i].peak = g_stats[i].allocated;
  });
  m.def("fallback_counts", [] {
    std::lock_guard<std::mutex> lk(g_count_mutex);
    return g_fallback_counts;
  });
  m.def("reset_fallback_counts", [] {
    std::lock_guard<std::mutex> lk(g_count_mutex);
    g_fallback_counts.clear();
  });
  m.def("default_generator", [](int i) { return default_generator(static_cast<c10::DeviceIndex>(i)); });
}
