/* The KV index's hot loop (router/kv_index.py): how far a chain of block hashes goes in one
 * tier of the index, in runs of equal holders. Built against Python.h and loaded with
 * ctypes.PyDLL (the GIL stays held); it only reads the dict and builds the result list.
 *
 * prefix_runs(holders, hashes): `holders` is a dict (an OrderedDict is one) from hash to the
 * holders' bitmask (an int), `hashes` a list or tuple of hashes. The answer is a list of
 * (end, bits) pairs: hashes[previous end:end] all map to bits equal to `bits`, and the last end
 * is the first hash not in the dict (or the chain's length). Holders change at a few blocks
 * of a chain only, so the list is short. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int append_run(PyObject *out, Py_ssize_t end, PyObject *bits) {
    PyObject *run = Py_BuildValue("(nO)", end, bits);
    if (run == NULL) return -1;
    int rc = PyList_Append(out, run);
    Py_DECREF(run);
    return rc;
}

PyObject *prefix_runs(PyObject *holders, PyObject *hashes) {
    if (!PyDict_Check(holders)) {
        PyErr_SetString(PyExc_TypeError, "holders must be a dict");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *last = NULL; /* owned: building the answer may run a collection that changes the dict */
    for (; out != NULL && i < n; i++) {
        PyObject *bits = PyDict_GetItemWithError(holders, items[i]);
        if (bits == NULL) {
            if (PyErr_Occurred()) Py_CLEAR(out);
            break;
        }
        if (last != NULL && bits != last) {
            int same = PyObject_RichCompareBool(bits, last, Py_EQ);
            if (same < 0 || (!same && append_run(out, i, last) < 0)) Py_CLEAR(out);
            if (same) continue;
        }
        Py_INCREF(bits);
        Py_XSETREF(last, bits);
    }
    if (out != NULL && last != NULL && append_run(out, i, last) < 0) Py_CLEAR(out);
    Py_XDECREF(last);
    Py_DECREF(seq);
    return out;
}
