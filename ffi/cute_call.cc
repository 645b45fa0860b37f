// XLA FFI handler that runs a CuTe DSL function exported with `export_to_c`.
//
// Instantiate (once per executable): take the ELF object from the `module` attribute, load it
// through libcute_dsl_runtime (one module per distinct `key`, kept for the process lifetime, since
// CUDA graphs captured by XLA may still launch its kernels), look up the function `prefix`, and
// keep the per-buffer ABI description in the FFI state.
//
// Execute: fill one tensor struct per buffer (inputs, then results that do not alias an input),
// in the layout the generated header declares, and call the function on XLA's stream:
//   struct { void *data; intS dynamic_shapes[k]; intW dynamic_strides[m]; }
//   args = { &struct_0, ..., &struct_{n-1}, &stream, &ret }
// Only the dims/strides flagged dynamic are stored, in mode order; strides are row-major,
// derived from XLA's dims. No host synchronisation, no device allocation: command-buffer safe.

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "CuteDSLRuntime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRank = 8;

struct BufferAbi {
  int32_t rank;
  uint32_t dyn_shape_mask;
  uint32_t dyn_stride_mask;
  int32_t shape_bytes;   // 4 or 8
  int32_t stride_bytes;  // 4 or 8
};

// Room for the largest struct: data pointer + kMaxRank 64-bit dims + kMaxRank 64-bit strides.
struct alignas(8) TensorStruct {
  unsigned char bytes[8 + 16 * kMaxRank];
};

std::string Describe(CuteDSLRT_Error_t err) {
  return std::string(CuteDSLRT_GetErrorName(err)) + ": " + CuteDSLRT_GetErrorString(err);
}

// Path of the loaded libcute_dsl_runtime.so: the JIT linker resolves the object's CUDA shims
// (_cudaLaunchKernelEx, ...) from the libraries it is given.
std::string RuntimeLibraryPath() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&CuteDSLRT_Module_Create_From_Bytes), &info) &&
      info.dli_fname) {
    return info.dli_fname;
  }
  return "";
}

// Loaded modules by content key; never destroyed (see top comment).
ffi::Error LoadFunction(std::string_view object, std::string_view key, std::string_view prefix,
                        CuteDSLRT_Function_t** fn) {
  static std::mutex mu;
  static auto* functions = new std::unordered_map<std::string, CuteDSLRT_Function_t*>();
  std::lock_guard<std::mutex> lock(mu);
  std::string cache_key = std::string(key) + "/" + std::string(prefix);
  if (auto it = functions->find(cache_key); it != functions->end()) {
    *fn = it->second;
    return ffi::Error::Success();
  }

  std::string runtime = RuntimeLibraryPath();
  const char* libs[] = {runtime.c_str()};
  CuteDSLRT_Module_t* module = nullptr;
  CuteDSLRT_Error_t err = CuteDSLRT_Module_Create_From_Bytes(
      &module, reinterpret_cast<const unsigned char*>(object.data()), object.size(), libs,
      runtime.empty() ? 0 : 1);
  if (err != CuteDSLRT_Success) {
    return ffi::Error::Internal("cute_call: loading the CuTe object (key " + std::string(key) +
                                ") failed: " + Describe(err));
  }
  std::string prefix_str(prefix);
  try {  // an unknown prefix throws instead of returning an error code
    err = CuteDSLRT_Module_Get_Function(fn, module, prefix_str.c_str());
  } catch (const std::exception& e) {
    CuteDSLRT_Module_Destroy(module);
    return ffi::Error::Internal("cute_call: no function '" + prefix_str + "' in the object: " +
                                e.what());
  }
  if (err != CuteDSLRT_Success) {  // this is where the cubin is loaded onto the GPUs
    CuteDSLRT_Module_Destroy(module);
    return ffi::Error::Internal("cute_call: getting function '" + prefix_str +
                                "' failed: " + Describe(err));
  }
  functions->emplace(cache_key, *fn);
  return ffi::Error::Success();
}

}  // namespace

struct CuteCallState {
  static ffi::TypeId id;
  CuteDSLRT_Function_t* fn;
  std::vector<BufferAbi> buffers;  // inputs then results, the launcher's tensor order
  uint64_t aliased_rets;           // bit j: result j aliases an input, so it is not passed again
};
ffi::TypeId CuteCallState::id = {};

static ffi::ErrorOr<std::unique_ptr<CuteCallState>> Instantiate(
    std::string_view module, std::string_view key, std::string_view prefix,
    ffi::Span<const int32_t> rank, ffi::Span<const int32_t> dyn_shape_mask,
    ffi::Span<const int32_t> dyn_stride_mask, ffi::Span<const int32_t> shape_bits,
    ffi::Span<const int32_t> stride_bits, int64_t aliased_rets) {
  size_t n = rank.size();
  if (dyn_shape_mask.size() != n || dyn_stride_mask.size() != n || shape_bits.size() != n ||
      stride_bits.size() != n) {
    return ffi::Unexpected(
        ffi::Error::InvalidArgument("cute_call: ABI attributes need one entry per buffer"));
  }
  auto state = std::make_unique<CuteCallState>();
  state->aliased_rets = static_cast<uint64_t>(aliased_rets);
  for (size_t i = 0; i < n; ++i) {
    bool widths_ok = (shape_bits[i] == 32 || shape_bits[i] == 64) &&
                     (stride_bits[i] == 32 || stride_bits[i] == 64);
    if (rank[i] < 0 || rank[i] > kMaxRank || !widths_ok) {
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          "cute_call: bad ABI for buffer " + std::to_string(i) + ": rank " +
          std::to_string(rank[i]) + ", widths " + std::to_string(shape_bits[i]) + "/" +
          std::to_string(stride_bits[i])));
    }
    state->buffers.push_back({rank[i], static_cast<uint32_t>(dyn_shape_mask[i]),
                              static_cast<uint32_t>(dyn_stride_mask[i]), shape_bits[i] / 8,
                              stride_bits[i] / 8});
  }
  if (ffi::Error err = LoadFunction(module, key, prefix, &state->fn); err.failure()) {
    return ffi::Unexpected(err);
  }
  return state;
}

// Writes `value` at `*offset` (aligned to its width) as a 4- or 8-byte integer.
static bool Put(TensorStruct& s, size_t* offset, int64_t value, int32_t width) {
  *offset = (*offset + width - 1) / width * width;
  if (width == 4) {
    if (value > INT32_MAX) return false;
    int32_t v = static_cast<int32_t>(value);
    std::memcpy(s.bytes + *offset, &v, 4);
  } else {
    std::memcpy(s.bytes + *offset, &value, 8);
  }
  *offset += width;
  return true;
}

static ffi::Error Pack(const BufferAbi& abi, void* data, ffi::Span<const int64_t> dims,
                       size_t index, TensorStruct& s) {
  if (static_cast<int32_t>(dims.size()) != abi.rank) {
    return ffi::Error::InvalidArgument("cute_call: buffer " + std::to_string(index) + " has rank " +
                                       std::to_string(dims.size()) + ", the kernel expects " +
                                       std::to_string(abi.rank));
  }
  std::memcpy(s.bytes, &data, sizeof(void*));
  size_t offset = sizeof(void*);
  bool fits = true;
  for (int i = 0; i < abi.rank; ++i) {
    if (abi.dyn_shape_mask >> i & 1) fits &= Put(s, &offset, dims[i], abi.shape_bytes);
  }
  int64_t stride = 1;
  int64_t strides[kMaxRank];
  for (int i = abi.rank - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= dims[i];
  }
  for (int i = 0; i < abi.rank; ++i) {
    if (abi.dyn_stride_mask >> i & 1) fits &= Put(s, &offset, strides[i], abi.stride_bytes);
  }
  if (!fits) {
    return ffi::Error::InvalidArgument("cute_call: buffer " + std::to_string(index) +
                                       " has a dim or stride beyond int32, which the kernel "
                                       "was compiled for");
  }
  return ffi::Error::Success();
}

static ffi::Error Execute(void* stream, CuteCallState* state, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  size_t n = state->buffers.size();
  std::vector<TensorStruct> structs(n);
  std::vector<void*> packed(n + 2);
  size_t i = 0;  // next kernel tensor
  auto pack = [&](const ffi::AnyBuffer& buffer) -> ffi::Error {
    if (i == n) return ffi::Error::InvalidArgument("cute_call: more buffers than kernel tensors");
    packed[i] = &structs[i];
    ffi::Error err = Pack(state->buffers[i], buffer.untyped_data(), buffer.dimensions(), i,
                          structs[i]);
    ++i;
    return err;
  };
  for (size_t a = 0; a < args.size(); ++a) {
    auto arg = args.get<ffi::AnyBuffer>(a);
    if (arg.has_error()) return arg.error();
    if (ffi::Error err = pack(*arg); err.failure()) return err;
  }
  for (size_t r = 0; r < rets.size(); ++r) {
    if (r < 64 && (state->aliased_rets >> r & 1)) continue;
    auto ret = rets.get<ffi::AnyBuffer>(r);
    if (ret.has_error()) return ret.error();
    if (ffi::Error err = pack(**ret); err.failure()) return err;
  }
  if (i != n) {
    return ffi::Error::InvalidArgument("cute_call: got " + std::to_string(i) +
                                       " buffers, the kernel takes " + std::to_string(n));
  }
  int32_t ret = 0;  // the launcher stores its CUDA error here
  packed[n] = &stream;
  packed[n + 1] = &ret;
  CuteDSLRT_Error_t err = CuteDSLRT_Function_Run(state->fn, packed.data(), packed.size());
  if (err != CuteDSLRT_Success || ret != 0) {
    return ffi::Error::Internal("cute_call: kernel launch failed: " + Describe(err) +
                                " (CUDA error " + std::to_string(ret) + ")");
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CuteCallInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<std::string_view>("module")
                                  .Attr<std::string_view>("key")
                                  .Attr<std::string_view>("prefix")
                                  .Attr<ffi::Span<const int32_t>>("rank")
                                  .Attr<ffi::Span<const int32_t>>("dyn_shape_mask")
                                  .Attr<ffi::Span<const int32_t>>("dyn_stride_mask")
                                  .Attr<ffi::Span<const int32_t>>("shape_bits")
                                  .Attr<ffi::Span<const int32_t>>("stride_bits")
                                  .Attr<int64_t>("aliased_rets"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CuteCallExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::State<CuteCallState>>()
                                  .RemainingArgs()
                                  .RemainingRets(),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {
// For jax.ffi.register_ffi_type: the state's type id (filled in by XLA) and its deleter.
__attribute__((visibility("default"))) void* CuteCallStateTypeId() { return &CuteCallState::id; }
__attribute__((visibility("default"))) void* CuteCallStateTypeInfo() {
  static XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<CuteCallState>();
  return &info;
}
}
