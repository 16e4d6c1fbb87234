// Op schemas, written once. Each backend registers its kernels in its own file
// (ops_cpu.cpp, ops_cuda.cpp); Python adds the fake (meta) kernels.
#include <Python.h>
#include <torch/library.h>

// Importing sparse_attn._C runs the static registrations below; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(sparse_attn, m) {
  m.def(
      "dense_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, float? scale=None, "
      "bool causal=False) -> (Tensor out, Tensor lse)");
  m.def(
      "flash_fwd(Tensor query, Tensor key, Tensor value, float? scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1) -> (Tensor out, Tensor lse)");
  m.def(
      "block_sparse_fwd(Tensor query, Tensor key, Tensor value, Tensor kv_num_blocks, Tensor kv_indices, "
      "Tensor kv_partial, Tensor partial_masks, int q_block, int kv_block, float? scale=None, "
      "Tensor? q_block_order=None) -> (Tensor out, Tensor lse)");
  m.def(
      "gather_fwd(Tensor query, Tensor key, Tensor value, Tensor indices, float? scale=None) "
      "-> (Tensor out, Tensor lse)");
  m.def("topk_select(Tensor query, Tensor key, int k, bool causal=False) -> Tensor");
  m.def(
      "indexer_select(Tensor index_query, Tensor index_key, Tensor index_weights, int k, "
      "bool causal=False) -> Tensor");
}
