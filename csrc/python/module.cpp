// The bare `_C` extension module (as in pytorch/extension-cpp): importing it loads
// libdtorch_ops.so, whose static TORCH_LIBRARY initialisers register the ops and classes. It
// defines no Python functions; the Python API uses torch.ops.dtorch and torch.classes.dtorch.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "dtorch_ops native library loader", -1,
      nullptr, nullptr, nullptr, nullptr, nullptr,
  };
  return PyModule_Create(&module_def);
}
