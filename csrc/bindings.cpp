// Python bindings of specengine._C: the KV block allocator and the CPU/CUDA kernels.
// torch/csrc/utils/pybind.h brings pybind11 with torch's at::Tensor casters; the whole of
// torch/extension.h (the C++ frontend) is not needed and would double the build time.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "allocator.h"
#include "kernels.h"
#include "ops.h"
#include "pool.h"

namespace py = pybind11;
using specengine::BlockAllocator;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specengine C++ extension: KV block allocator, paged attention, small-M linear";

  py::class_<BlockAllocator>(m, "BlockAllocator",
                             "Free list + reference counts over num_blocks KV blocks.")
      .def(py::init<int64_t>(), py::arg("num_blocks"))
      .def("allocate", &BlockAllocator::allocate,
           "A free block id with refcount 1; RuntimeError 'out of KV blocks' when none.")
      .def("allocate_n", &BlockAllocator::allocate_n, py::arg("n"),
           "n block ids, all or nothing (RuntimeError when fewer than n are free).")
      .def("incref", &BlockAllocator::incref, py::arg("block_id"))
      .def("free", &BlockAllocator::free, py::arg("block_id"),
           "Drop one reference; the block is free again at zero. RuntimeError on double free.")
      .def("refcount", &BlockAllocator::refcount, py::arg("block_id"))
      .def_property_readonly("num_free", &BlockAllocator::num_free)
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks)
      .def("__repr__", [](const BlockAllocator& a) {
        return "BlockAllocator(num_blocks=" + std::to_string(a.num_blocks()) +
               ", num_free=" + std::to_string(a.num_free()) + ")";
      });

  m.def("paged_attention", &specengine::paged_attention_cpu, py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_seq"),
        py::arg("kv_lens"), py::arg("scale"), py::arg("tree_base") = py::none(),
        py::arg("tree_mask") = py::none(),
        "Paged attention on CPU tensors -> [T, H, D] in query's dtype.");
  m.def("write_kv", &specengine::write_kv_cpu, py::arg("k_cache"), py::arg("v_cache"),
        py::arg("key"), py::arg("value"), py::arg("slot_mapping"));
  m.def("store_rows", &specengine::store_rows_cpu, py::arg("data"), py::arg("valid"),
        py::arg("slots"), py::arg("rows"),
        "data[slots] = rows; valid[slots] = True (rows: [len(slots), H]).");
  m.def("linear", &specengine::linear_cpu, py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none(), "x @ weight.T + bias with batch-invariant rows.");
  m.def("amx_available", &specengine::amx_available,
        "True when AMX-BF16 tiles are usable (CPU support and Linux permission granted) and "
        "the instruction-set cap is amx.");
  m.def("amx_supported", &specengine::amx_supported,
        "True when the CPU and OS allow AMX-BF16 tiles, whatever the cap.");
  m.def("pack_weight_amx", &specengine::amx_pack_weight, py::arg("weight"),
        py::arg("glu") = false, "[N, K] bf16 weight -> AMX tile layout for linear_amx.");
  m.def("linear_amx", &specengine::amx_linear, py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("glu") = false, py::arg("out_f32") = false,
        "x [M, K] bf16 @ packed weight -> [M, N] bf16, or float32 with out_f32 (glu: "
        "silu(gate) * up, [M, N/2] bf16); rows are batch-invariant.");
  m.def("avx512_linear_available", &specengine::avx512_linear_available, py::arg("bf16"),
        "True when the CPU has the AVX-512 (and, for bf16, AVX-512 BF16) the kernel needs.");
  m.def("pack_weight_avx512", &specengine::avx512_pack_weight, py::arg("weight"),
        py::arg("glu") = false, "[N, K] bf16/f32 weight -> 64-feature groups for linear_avx512.");
  m.def("linear_avx512", &specengine::avx512_linear, py::arg("x"), py::arg("packed"),
        py::arg("n"), py::arg("bias") = py::none(), py::arg("glu") = false,
        py::arg("out_f32") = false,
        "x [M, K] @ packed weight -> [M, N] (glu: silu(gate) * up, [M, N/2]) in x's dtype or "
        "float32; rows are batch-invariant.");
  m.def("avx2_linear_available", &specengine::avx2_linear_available,
        "True when the CPU has AVX2 + FMA and the ISA cap allows it.");
  m.def("linear_avx2", &specengine::avx2_linear, py::arg("x"), py::arg("packed"),
        py::arg("n"), py::arg("bias") = py::none(), py::arg("glu") = false,
        py::arg("out_f32") = false,
        "linear_avx512 on AVX2 + FMA CPUs, over the same packed weights.");
  m.def("set_isa_cap", &specengine::set_isa_cap, py::arg("level"),
        "Cap the run-time dispatch at 0 generic, 1 AVX2, 2 AVX-512 (all, the default).");
  m.def("isa_cap", &specengine::isa_cap);
  m.def("rope_", &specengine::rope_inplace_cpu, py::arg("x"), py::arg("cos"), py::arg("sin"),
        "In-place rotate-half RoPE of x [T, H, D] with float32 cos/sin [T, D] (sin signed).");
  m.def("rms_norm", &specengine::rms_norm_cpu, py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &specengine::add_rms_norm_cpu, py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &specengine::silu_and_mul_cpu, py::arg("x"));
  m.def("cpu_isa", &specengine::cpu_isa);
  m.def("exponential_noise", &specengine::exponential_noise, py::arg("key"),
        py::arg("positions"), py::arg("vocab"),
        "Exp(1) sampling noise [P, vocab] float32 of (key, position) rows, counter-based.");
  m.def("exponential_noise_batch", &specengine::exponential_noise_batch, py::arg("keys"),
        py::arg("positions"), py::arg("vocab"),
        "exponential_noise of (keys[r], positions[r]) in row r: [P, vocab] float32, one call.");
  m.def("exponential_race", &specengine::exponential_race, py::arg("probs"), py::arg("keys"),
        py::arg("positions"),
        "[S] int64: argmax(probs[r] / exponential_noise(keys[r], [positions[r]], V)[0]) per "
        "row, the noise never stored.");
  m.def("argmax_rows", &specengine::argmax_rows, py::arg("x"),
        "[R] int64: the index of each row's largest value of x [R, V] float32 (the first among "
        "equals, the first NaN if any: torch.argmax's rule), rows in parallel.");
  m.def("softmax_rows", &specengine::softmax_rows, py::arg("x"),
        "[R, V] float32: the softmax of each row of x [R, V] float32, one definition whatever R "
        "or the thread count (fixed 8192-value chunks summed in order), rows and chunks in "
        "parallel on the kernel pool.");
  m.def("softmax_race", &specengine::softmax_race, py::arg("x"), py::arg("keys"),
        py::arg("positions"), py::arg("rows") = py::none(),
        "[S] int64: exponential_race(softmax_rows(x), keys, positions) bit for bit, the "
        "probabilities never stored (a row's passes on one thread when rows are many); with "
        "rows ([S] int64 row indices), the race of x[rows] without gathering them.");
  m.def("coupled_topk", &specengine::coupled_topk, py::arg("logits"), py::arg("k"),
        py::arg("temperature"), py::arg("keys"), py::arg("positions"),
        py::arg("vocab_map") = py::none(),
        "(values [R, k] float32, indices [R, k] int64): per row the k largest of "
        "log_softmax(z), z = logits (temperature 0) or logits / temperature - log E with E the "
        "noise of (keys[r], positions[r]) at token vocab_map[i]; the noise never stored.");
  m.def("eagle_draft", &specengine::eagle_draft, py::arg("prefix_ids"),
        py::arg("prefix_feats"), py::arg("prefix_pos"), py::arg("prefix_seq"), py::arg("last"),
        py::arg("weights"),
        py::arg("sizes"), py::arg("kind"), py::arg("glu"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("eps"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("lengths"),
        py::arg("block_size"), py::arg("temperature"), py::arg("keys"), py::arg("n_out"),
        py::arg("vocab_map"), py::arg("depth"), py::arg("topk"), py::arg("budget"),
        "EagleDrafter.propose's drafting in one call (prefix feed, the loop over depths, the "
        "trees): (nodes [B], token [B, budget], parent [B, budget], draft logprob [B, budget] "
        "f64), each sequence's tree in its first nodes[b] columns.");
  m.def("decoder_forward", &specengine::decoder_forward, py::arg("hidden"), py::arg("cos"),
        py::arg("sin"), py::arg("layers"), py::arg("biases"), py::arg("sizes"), py::arg("kind"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
        py::arg("eps"), py::arg("k_caches"), py::arg("v_caches"), py::arg("slot_mapping"),
        py::arg("block_tables"), py::arg("query_seq"), py::arg("kv_lens"), py::arg("tree_base"),
        py::arg("tree_mask"), py::arg("final_norm"),
        "LlamaForCausalLM's decoder layers and final norm in one call (the Python layer loop's "
        "kernels in its order): hidden [T, H] -> final-norm hidden [T, H]; writes the K/V.");
  m.def(
      "param_stamps",
      [](const py::list& dicts, const py::list& names) {
        // [len(dicts) * len(names), 3] int64: per (dict, name) the object's address, its
        // tensor's data pointer and version counter (-1: an inference tensor, which has none);
        // zeros where the name is absent or None.
        const int64_t n = static_cast<int64_t>(dicts.size() * names.size());
        auto out = at::zeros({n, 3}, at::TensorOptions().dtype(at::kLong));
        int64_t* o = out.data_ptr<int64_t>();
        for (const auto d : dicts) {
          if (!PyDict_Check(d.ptr())) throw py::type_error("param_stamps: dicts must hold dicts");
          for (const auto name : names) {
            PyObject* v = PyDict_GetItem(d.ptr(), name.ptr());  // borrowed
            if (v != nullptr && v != Py_None) {
              if (!THPVariable_Check(v)) {
                throw py::type_error("param_stamps: a value is neither a tensor nor None");
              }
              const at::Tensor& t = THPVariable_Unpack(v);
              o[0] = reinterpret_cast<int64_t>(v);
              o[1] = reinterpret_cast<int64_t>(t.has_storage() ? t.data_ptr() : nullptr);
              o[2] = t.is_inference() ? -1 : static_cast<int64_t>(t._version());
            }
            o += 3;
          }
        }
        return out;
      },
      py::arg("dicts"), py::arg("names"),
      "[len(dicts) * len(names), 3] int64: per module parameter dict and name, the "
      "parameter's id, data pointer and version counter (zeros: absent or None) in one call.");
  m.def("set_pool_threads", &specengine::set_pool_threads, py::arg("n"),
        "Threads of the kernels' pool (0: follow torch.get_num_threads()).");
  m.def("pool_threads", &specengine::pool_threads, "Threads the kernels' pool uses now.");
  m.def(
      "pool_stats",
      [](bool reset) {
        const auto s = specengine::pool_stats(reset);
        py::dict d;
        d["jobs"] = s.jobs;
        d["helper_chunks"] = s.helper_chunks;
        d["waits"] = s.waits;
        d["sleeps"] = s.sleeps;
        d["wait_ns"] = s.wait_ns;
        d["late_helpers"] = s.late_helpers;
        return d;
      },
      py::arg("reset") = false,
      "The pool's counters (reset=True: and zero them): jobs, helper_chunks, waits (jobs whose "
      "caller waited for a helper's chunk), sleeps (of those, slept through), wait_ns, "
      "late_helpers (a spinning helper found its job done: it was not on a core).");
#ifdef SPECENGINE_WITH_CUDA
  m.def("paged_attention_cuda", &specengine::paged_attention_cuda, py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_seq"),
        py::arg("kv_lens"), py::arg("scale"), py::arg("tree_base") = py::none(),
        py::arg("tree_mask") = py::none());
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
