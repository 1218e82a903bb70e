/* The CPython extension of musecore-xeon (musecore_xeon/kernels/binding.py builds it with PyTorch's and Python's
   headers): the bound GEMVs, the decode-size norms, the router selection, the decode attention and the fused MoE,
   called without ctypes (checks, at::empty, the C kernel of kernels.c by its address). */
#include <Python.h>
#include <cstdint>
#include <cstring>
#include <c10/util/BFloat16.h>
#include <vector>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/python_variable.h>

/* The bound weights of the C source (int4.c, bf16.c); the Python side passes the
   address of its ctypes copy. Each kernel is called as fn(weight, x, y, m_rows, x_is_bf16). */
typedef struct { const void *codes; const void *sz; int64_t k, g, n_rows, n_valid; } int4_weight_t;
typedef struct { const void *w; int64_t k, n; } bf16_weight_t;
typedef void (*linear_fn)(const void *, const void *, void *, int64_t, int);
static linear_fn int4_linear_kernel, bf16_linear_kernel;

static PyObject *set_kernels(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_kernels(int4_address, bf16_address) takes 2 arguments; got %zd", nargs);
        return nullptr;
    }
    int4_linear_kernel = (linear_fn)PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) return nullptr;
    bf16_linear_kernel = (linear_fn)PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
}

/* The call shared by every bound kernel: unpack x, check it against K, at::empty(..., n) in x's dtype, the kernel
   with the GIL released (as ctypes does). `name` prefixes the errors. */
static PyObject *call_linear(const char *name, linear_fn kernel, const void *w, int64_t k, int64_t n,
                             PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(weight_address, x) takes 2 arguments; got %zd", name, nargs);
        return nullptr;
    }
    if (kernel == nullptr) {
        PyErr_Format(PyExc_RuntimeError, "%s: set_kernels() was not called with the kernels' addresses", name);
        return nullptr;
    }
    if (!THPVariable_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s: x must be a torch.Tensor; got %s", name, Py_TYPE(args[1])->tp_name);
        return nullptr;
    }
    try {
        const at::Tensor &x = THPVariable_Unpack(args[1]);
        const at::ScalarType dtype = x.scalar_type();
        const bool bf16 = dtype == at::kBFloat16;
        if ((!bf16 && dtype != at::kFloat) || !x.device().is_cpu() || x.dim() == 0 || x.size(-1) != k
                || !x.is_contiguous()) {
            /* the message from the tensor's Python attributes: c10's string helpers crashed on this path with
               torch 2.11 (a segfault on the GPU machine's host), and Python's repr is what users read anyway */
            PyObject *dt = PyObject_GetAttrString(args[1], "dtype"), *shape = PyObject_GetAttrString(args[1], "shape"),
                     *device = PyObject_GetAttrString(args[1], "device");
            if (dt != nullptr && shape != nullptr && device != nullptr)
                PyErr_Format(PyExc_ValueError, "%s: x must be a contiguous bf16/fp32 CPU [..., %lld] tensor; got %R %R on "
                             "%R (contiguous=%s)", name, (long long)k, dt, shape, device,
                             x.is_contiguous() ? "True" : "False");
            Py_XDECREF(dt); Py_XDECREF(shape); Py_XDECREF(device);
            return nullptr;
        }
        c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
        sizes.back() = n;
        at::Tensor y = at::empty(sizes, x.options());
        const int64_t m = x.numel() / k;
        const void *xp = x.const_data_ptr();
        void *yp = y.mutable_data_ptr();
        Py_BEGIN_ALLOW_THREADS
        kernel(w, xp, yp, m, bf16);
        Py_END_ALLOW_THREADS
        return THPVariable_Wrap(std::move(y));
    } catch (const std::exception &err) {
        PyErr_SetString(PyExc_RuntimeError, err.what());
        return nullptr;
    }
}

/* The struct at the address obj holds (a Python int), or nullptr with a ValueError / the conversion's error set. */
template <typename Struct> static const Struct *struct_at(const char *name, PyObject *obj) {
    const Struct *p = (const Struct *)PyLong_AsVoidPtr(obj);
    if (p == nullptr && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: the address is null", name);
    return p;
}

template <typename Weight>
static const Weight *weight_at(const char *name, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_Format(PyExc_TypeError, "%s(weight_address, x) takes 2 arguments; got %zd", name, nargs);
        return nullptr;
    }
    return struct_at<Weight>(name, args[0]);
}

/* int4_linear(weight_address, x) -> y [..., n_valid] in x's dtype */
static PyObject *int4_linear(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    const int4_weight_t *w = weight_at<int4_weight_t>("int4_gemv", args, nargs);
    return w == nullptr ? nullptr : call_linear("int4_gemv", int4_linear_kernel, w, w->k, w->n_valid, args, nargs);
}

/* bf16_linear(weight_address, x) -> y [..., n] in x's dtype */
static PyObject *bf16_linear(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    const bf16_weight_t *w = weight_at<bf16_weight_t>("bf16_gemv", args, nargs);
    return w == nullptr ? nullptr : call_linear("bf16_gemv", bf16_linear_kernel, w, w->k, w->n, args, nargs);
}

/* The decode-size norms and the router's selection of ops.c, called without ctypes (a ctypes call with its Python
   checks and torch.empty_like cost more than the kernel; a muse-small token makes ~100 of them).
   Each returns None when its fast path does not apply (a tensor that is not a contiguous bf16/fp32 CPU tensor, more
   than max_elements, shapes that do not match): the Python op then takes its PyTorch path (the same math). */
typedef void (*rms_fn)(const void *, int, const void *, int, void *, int, int64_t, int64_t, float, int);
typedef void (*residual_fn)(const void *, const void *, int, const void *, int, const float *, const float *,
                            const void *, int, void *, void *, int, int64_t, int64_t, float, float);
typedef void (*rope_fn)(const void *, int, int64_t, float, const float *, const float *, void *, int64_t, int64_t,
                        int64_t, float);
typedef void (*gate_fn)(const void *, int, const void *, int, int64_t, void *, int64_t, int64_t, int64_t, float);
typedef int (*router_fn)(const float *, const float *, int64_t, int64_t, int64_t, float, float, float *, int64_t *);
typedef void (*attention_fn)(const void *, int, const void *, const void *, int, const int64_t *, const int64_t *,
                             int64_t, float, void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int);
typedef int (*fused_router_fn)(const void *, int, const float *, const float *, int64_t, int64_t, int64_t, int64_t,
                               float, float, float *, int64_t *, int);
typedef void (*softcap_fn)(const void *, int, float *, int64_t, float, float, const void *, int64_t, int);
static rms_fn rms_kernel;
static residual_fn residual_kernel;
static rope_fn rope_kernel;
static gate_fn gate_kernel;
static router_fn router_kernel;
static attention_fn attention_kernel;
static fused_router_fn fused_router_kernel;
static softcap_fn softcap_kernel;
static const void *vml_tanh;  /* PyTorch's tanh kernel (MKL VML's vmsTanh) or nullptr: see set_tanh */
static int64_t vml_tanh_mode;
static int64_t max_elements, max_queries;

static PyObject *set_ops(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "set_ops(rms, residual, rope, gate, router_topk, attention, router, softcap, "
                     "max_elements, max_queries) takes 10 arguments; got %zd", nargs);
        return nullptr;
    }
    void *a[8];
    for (int i = 0; i < 8; ++i) {
        a[i] = PyLong_AsVoidPtr(args[i]);
        if (PyErr_Occurred()) return nullptr;
    }
    const long long limit = PyLong_AsLongLong(args[8]), queries = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred()) return nullptr;
    rms_kernel = (rms_fn)a[0];
    residual_kernel = (residual_fn)a[1];
    rope_kernel = (rope_fn)a[2];
    gate_kernel = (gate_fn)a[3];
    router_kernel = (router_fn)a[4];
    attention_kernel = (attention_fn)a[5];
    fused_router_kernel = (fused_router_fn)a[6];
    softcap_kernel = (softcap_fn)a[7];
    max_elements = limit;
    max_queries = queries;
    Py_RETURN_NONE;
}

/* set_tanh(address | 0, mode): the tanh that logit_softcap calls (PyTorch's own: MKL VML's vmsTanh, Fortran entry,
   with PyTorch's mode), found and checked against torch.tanh by musecore_xeon.kernels.native; 0: logit_softcap
   returns None (the PyTorch path). */
static PyObject *set_tanh(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_tanh(address, mode) takes 2 arguments; got %zd", nargs);
        return nullptr;
    }
    const void *fn = PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) return nullptr;
    const long long mode = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return nullptr;
    vml_tanh = fn;
    vml_tanh_mode = mode;
    Py_RETURN_NONE;
}

/* The tensor behind obj if it is a contiguous CPU tensor of fp32 (or bf16, unless f32_only) with at least one dim and
   at most max_elements elements (any size when !bounded: a KV cache), else nullptr. */
static const at::Tensor *operand(PyObject *obj, bool f32_only = false, bool bounded = true) {
    if (!THPVariable_Check(obj)) return nullptr;
    const at::Tensor &t = THPVariable_Unpack(obj);
    const at::ScalarType s = t.scalar_type();
    if ((s != at::kFloat && (f32_only || s != at::kBFloat16)) || !t.device().is_cpu() || !t.is_contiguous()
            || t.dim() == 0 || (bounded && t.numel() > max_elements))
        return nullptr;
    return &t;
}

/* An optional operand: *present says whether obj is not None; the tensor as operand() takes it (nullptr: None, or not
   taken: then *present is true). */
static const at::Tensor *optional_operand(PyObject *obj, bool *present, bool f32_only = false) {
    *present = obj != Py_None;
    return *present ? operand(obj, f32_only) : nullptr;
}

/* The tensor behind obj if it is a 4-D [B, T, heads, d] fp32/bf16 CPU tensor of at most max_elements elements whose
   head rows are contiguous and whose (B, T) collapse to one token index (a contiguous tensor, or a view of the heads of
   a wider projection output, as a split of the fused q/k/v/gate projection gives), else nullptr; *tok_stride is the
   elements between tokens. */
static const at::Tensor *head_rows(PyObject *obj, int64_t *tok_stride) {
    if (!THPVariable_Check(obj)) return nullptr;
    const at::Tensor &t = THPVariable_Unpack(obj);
    const at::ScalarType s = t.scalar_type();
    if ((s != at::kFloat && s != at::kBFloat16) || !t.device().is_cpu() || t.dim() != 4 || t.numel() > max_elements
            || t.numel() == 0)
        return nullptr;
    const int64_t d = t.size(3);
    if ((t.size(3) > 1 && t.stride(3) != 1) || (t.size(2) > 1 && t.stride(2) != d))
        return nullptr;
    if (t.size(1) > 1) {  /* token stride of T; B must follow it */
        if (t.size(0) > 1 && t.stride(0) != t.size(1) * t.stride(1)) return nullptr;
        *tok_stride = t.stride(1);
    } else {
        *tok_stride = t.size(0) > 1 ? t.stride(0) : t.size(2) * d;
    }
    if (*tok_stride < t.size(2) * d) return nullptr;
    return &t;
}

/* The tensor behind obj if it is a contiguous int64 CPU tensor of the given 2-D shape, else nullptr. */
static const at::Tensor *positions(PyObject *obj, int64_t rows, int64_t cols) {
    if (!THPVariable_Check(obj)) return nullptr;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (t.scalar_type() != at::kLong || !t.device().is_cpu() || !t.is_contiguous() || t.dim() != 2
            || t.size(0) != rows || t.size(1) != cols)
        return nullptr;
    return &t;
}

static inline int bf(const at::Tensor *t) { return t != nullptr && t->scalar_type() == at::kBFloat16; }
static inline const void *data(const at::Tensor *t) { return t == nullptr ? nullptr : t->const_data_ptr(); }

/* The argument count and the kernel's registration. */
static bool op_call(const char *name, Py_ssize_t nargs, Py_ssize_t want, const void *kernel) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments; got %zd", name, want, nargs);
        return false;
    }
    if (kernel == nullptr) {
        PyErr_Format(PyExc_RuntimeError, "%s: set_ops() was not called with the kernels' addresses", name);
        return false;
    }
    return true;
}

/* Python floats (or ints) args[from .. from + n - 1] into out; false with a TypeError set otherwise. */
static bool numbers(PyObject *const *args, Py_ssize_t from, Py_ssize_t n, double *out) {
    for (Py_ssize_t i = 0; i < n; ++i) {
        out[i] = PyFloat_AsDouble(args[from + i]);
        if (PyErr_Occurred()) return false;
    }
    return true;
}

/* f() with a C++ exception turned into a RuntimeError */
template <typename F> static PyObject *guarded(F &&f) {
    try {
        return f();
    } catch (const std::exception &err) {
        PyErr_SetString(PyExc_RuntimeError, err.what());
        return nullptr;
    }
}

static PyObject *pair(at::Tensor a, at::Tensor b) {
    PyObject *tuple = PyTuple_New(2);
    if (tuple == nullptr) return nullptr;
    PyTuple_SET_ITEM(tuple, 0, THPVariable_Wrap(std::move(a)));
    PyTuple_SET_ITEM(tuple, 1, THPVariable_Wrap(std::move(b)));
    return tuple;
}

/* rms_norm(x, w | None, eps, scale_first) -> the rms_norm of musecore/ops in x's dtype, or None */
static PyObject *rms_norm(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    double eps;
    if (!op_call("rms_norm", nargs, 4, (const void *)rms_kernel) || !numbers(args, 2, 1, &eps)) return nullptr;
    const int scale_first = PyObject_IsTrue(args[3]);
    if (scale_first < 0) return nullptr;
    bool has_w;
    const at::Tensor *x = operand(args[0]), *w = optional_operand(args[1], &has_w);
    if (x == nullptr || (has_w && w == nullptr) || x->size(-1) == 0 || (has_w && w->numel() != x->size(-1))
            || (scale_first && !has_w))
        Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        const int64_t n = x->size(-1);
        at::Tensor out = at::empty(x->sizes(), x->options());
        rms_kernel(x->const_data_ptr(), bf(x), data(w), bf(w), out.mutable_data_ptr(), bf(x), x->numel() / n, n,
                   (float)eps, scale_first);
        return THPVariable_Wrap(std::move(out));
    });
}

/* residual_norm(residual, out, post_w | None, alpha, beta, next_w | None, post_eps, eps) -> (residual', normed), or
   None; alpha and beta fp32 [n] */
static PyObject *residual_norm(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    double eps[2];
    if (!op_call("residual_norm", nargs, 8, (const void *)residual_kernel) || !numbers(args, 6, 2, eps)) return nullptr;
    bool has_pw, has_nw;
    const at::Tensor *res = operand(args[0]), *out = operand(args[1]), *pw = optional_operand(args[2], &has_pw),
                     *alpha = operand(args[3], true), *beta = operand(args[4], true),
                     *nw = optional_operand(args[5], &has_nw);
    if (res == nullptr || out == nullptr || (has_pw && pw == nullptr) || alpha == nullptr || beta == nullptr
            || (has_nw && nw == nullptr))
        Py_RETURN_NONE;
    const int64_t n = res->size(-1);
    if (n == 0 || out->sizes() != res->sizes() || (has_pw && pw->numel() != n) || alpha->numel() != n
            || beta->numel() != n || (has_nw && nw->numel() != n))
        Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        at::Tensor new_res = at::empty(res->sizes(), res->options()), normed = at::empty(res->sizes(), res->options());
        residual_kernel(res->const_data_ptr(), out->const_data_ptr(), bf(out), data(pw), bf(pw),
                        alpha->const_data_ptr<float>(), beta->const_data_ptr<float>(), data(nw), bf(nw),
                        new_res.mutable_data_ptr(), normed.mutable_data_ptr(), bf(res), res->numel() / n, n,
                        (float)eps[0], (float)eps[1]);
        return pair(std::move(new_res), std::move(normed));
    });
}

/* qk_norm_rope(q, k, cos | None, sin | None, eps, q_scale) with q [B,T,nq,d], k [B,T,nkv,d] (contiguous or views of
   the fused projection, see head_rows), cos/sin fp32 [B,T,d] (both None: a NoPE layer) -> contiguous (q', k'), or
   None */
static PyObject *qk_norm_rope(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    double num[2];
    if (!op_call("qk_norm_rope", nargs, 6, (const void *)rope_kernel) || !numbers(args, 4, 2, num)) return nullptr;
    bool has_cos, has_sin;
    int64_t q_stride = 0, k_stride = 0;
    const at::Tensor *q = head_rows(args[0], &q_stride), *k = head_rows(args[1], &k_stride),
                     *cs = optional_operand(args[2], &has_cos, true), *sn = optional_operand(args[3], &has_sin, true);
    if (q == nullptr || k == nullptr || has_cos != has_sin || (has_cos && (cs == nullptr || sn == nullptr)))
        Py_RETURN_NONE;
    const int64_t B = q->size(0), T = q->size(1), d = q->size(3);
    if (d > 1024 || k->size(0) != B || k->size(1) != T || k->size(3) != d)
        Py_RETURN_NONE;
    if (has_cos && (cs->dim() != 3 || cs->size(0) != B || cs->size(1) != T || cs->size(2) != d
                    || sn->sizes() != cs->sizes()))
        Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        at::Tensor qo = at::empty(q->sizes(), q->options().memory_format(at::MemoryFormat::Contiguous)),
                   ko = at::empty(k->sizes(), k->options().memory_format(at::MemoryFormat::Contiguous));
        const float *cp = has_cos ? cs->const_data_ptr<float>() : nullptr, *sp = has_cos ? sn->const_data_ptr<float>() : nullptr;
        rope_kernel(q->const_data_ptr(), bf(q), q_stride, (float)num[1], cp, sp, qo.mutable_data_ptr(), q->numel() / d,
                    q->size(2), d, (float)num[0]);
        rope_kernel(k->const_data_ptr(), bf(k), k_stride, 1.0f, cp, sp, ko.mutable_data_ptr(), k->numel() / d,
                    k->size(2), d, (float)num[0]);
        return pair(std::move(qo), std::move(ko));
    });
}

/* head_norm_gate(o, gate_logits, eps) with o contiguous [B,T,nq,d] and gate_logits of o's shape (contiguous or a view
   of the fused projection, see head_rows) -> rms(o) * sigmoid(gate) in o's dtype, or None */
static PyObject *head_norm_gate(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    double eps;
    if (!op_call("head_norm_gate", nargs, 3, (const void *)gate_kernel) || !numbers(args, 2, 1, &eps)) return nullptr;
    int64_t g_stride = 0;
    const at::Tensor *o = operand(args[0]), *g = head_rows(args[1], &g_stride);
    if (o == nullptr || g == nullptr || g->sizes() != o->sizes()) Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        const int64_t d = o->size(-1);
        at::Tensor out = at::empty(o->sizes(), o->options());
        gate_kernel(o->const_data_ptr(), bf(o), g->const_data_ptr(), bf(g), g_stride, out.mutable_data_ptr(),
                    o->numel() / d, o->size(2), d, (float)eps);
        return THPVariable_Wrap(std::move(out));
    });
}

/* router_topk(logits fp32 [T, E], bias fp32 [E] | None, k, multiplier, scaling) -> (weights fp32 [T, k], ids int64
   [T, k]): the selection of the router_topk contract from the router's logits, or None */
static PyObject *router_topk(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    double num[2];
    if (!op_call("router_topk", nargs, 5, (const void *)router_kernel) || !numbers(args, 3, 2, num)) return nullptr;
    const long long k = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return nullptr;
    bool has_bias;
    const at::Tensor *logits = operand(args[0], true), *bias = optional_operand(args[1], &has_bias, true);
    if (logits == nullptr || logits->dim() != 2 || (has_bias && (bias == nullptr || bias->numel() != logits->size(1)))
            || k <= 0 || k > logits->size(1))
        Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        const int64_t T = logits->size(0), E = logits->size(1);
        at::Tensor weights = at::empty({T, (int64_t)k}, logits->options().dtype(at::kFloat)),
                   ids = at::empty({T, (int64_t)k}, logits->options().dtype(at::kLong));
        if (router_kernel(logits->const_data_ptr<float>(), has_bias ? bias->const_data_ptr<float>() : nullptr, T, E, k,
                          (float)num[0], (float)num[1], weights.mutable_data_ptr<float>(),
                          ids.mutable_data_ptr<int64_t>()) != 0) {
            PyErr_Format(PyExc_MemoryError, "router_topk: no memory for the scratch of %lld experts", (long long)E);
            return (PyObject *)nullptr;
        }
        return pair(std::move(weights), std::move(ids));
    });
}

/* attention(q, k, v, q_pos, k_pos, window, scale, threads) with q [B,T,nq,d] (T <= max_queries), k and v [B,S,nkv,d] of
   one dtype, int64 positions [B,T] and [B,S], window an int (<= 0: none) -> the decode attention of
   ops.c in q's dtype, or None */
static PyObject *attention(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!op_call("attention", nargs, 8, (const void *)attention_kernel)) return nullptr;
    const long long window = PyLong_AsLongLong(args[5]), threads = PyLong_AsLongLong(args[7]);
    const double scale = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred()) return nullptr;
    const at::Tensor *q = operand(args[0]), *k = operand(args[1], false, false), *v = operand(args[2], false, false);
    if (q == nullptr || k == nullptr || v == nullptr || q->dim() != 4 || k->dim() != 4 || k->sizes() != v->sizes()
            || k->scalar_type() != v->scalar_type())
        Py_RETURN_NONE;
    const int64_t B = q->size(0), T = q->size(1), nq = q->size(2), d = q->size(3), S = k->size(1), nkv = k->size(2);
    if (T > max_queries || k->size(0) != B || k->size(3) != d || nkv == 0 || nq % nkv || d == 0 || threads < 1
            || B * S > INT32_MAX)  /* the kernel lists visible key rows as int32 */
        Py_RETURN_NONE;
    const at::Tensor *qp = positions(args[3], B, T), *kp = positions(args[4], B, S);
    if (qp == nullptr || kp == nullptr) Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        at::Tensor out = at::empty(q->sizes(), q->options());
        const void *qd = q->const_data_ptr(), *kd = k->const_data_ptr(), *vd = v->const_data_ptr();
        const int64_t *qpd = qp->const_data_ptr<int64_t>(), *kpd = kp->const_data_ptr<int64_t>();
        void *od = out.mutable_data_ptr();
        const int qb = bf(q), kvb = bf(k);
        Py_BEGIN_ALLOW_THREADS
        attention_kernel(qd, qb, kd, vd, kvb, qpd, kpd, window > 0 ? window : -1, (float)scale, od, B, T, S, nq, nkv, d,
                         (int)threads);
        Py_END_ALLOW_THREADS
        return THPVariable_Wrap(std::move(out));
    });
}

/* router(x [T, H], weight fp32 [E, H], bias fp32 [E] | None, k, multiplier, scaling, threads) -> (weights fp32 [T, k],
   ids int64 [T, k]): router_topk in one C call (the logits too, within the op's tolerance), or None (x not a
   contiguous bf16/fp32 2-D CPU tensor of at most max_queries rows and max_elements elements, the weight not fp32) */
static PyObject *router(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    double num[2];
    if (!op_call("router", nargs, 7, (const void *)fused_router_kernel) || !numbers(args, 4, 2, num)) return nullptr;
    const long long k = PyLong_AsLongLong(args[3]), threads = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return nullptr;
    bool has_bias;
    const at::Tensor *x = operand(args[0]), *w = operand(args[1], true, false),
                     *bias = optional_operand(args[2], &has_bias, true);
    if (x == nullptr || w == nullptr || x->dim() != 2 || w->dim() != 2 || x->size(0) > max_queries
            || x->size(1) != w->size(1) || x->size(1) == 0 || w->size(0) == 0
            || (has_bias && (bias == nullptr || bias->numel() != w->size(0))) || k <= 0 || k > w->size(0)
            || threads < 1)
        Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        const int64_t T = x->size(0), H = x->size(1), E = w->size(0);
        at::Tensor weights = at::empty({T, (int64_t)k}, x->options().dtype(at::kFloat)),
                   ids = at::empty({T, (int64_t)k}, x->options().dtype(at::kLong));
        const void *xd = x->const_data_ptr();
        const float *wd = w->const_data_ptr<float>(), *bd = has_bias ? bias->const_data_ptr<float>() : nullptr;
        float *wo = weights.mutable_data_ptr<float>();
        int64_t *io = ids.mutable_data_ptr<int64_t>();
        const int xb = bf(x);
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = fused_router_kernel(xd, xb, wd, bd, T, E, H, k, (float)num[0], (float)num[1], wo, io, (int)threads);
        Py_END_ALLOW_THREADS
        if (status != 0) {
            PyErr_Format(PyExc_MemoryError, "router: no memory for the scratch of %lld experts", (long long)E);
            return (PyObject *)nullptr;
        }
        return pair(std::move(weights), std::move(ids));
    });
}

/* logit_softcap(logits, multiplier, cap, threads) -> tanh(fp32(logits) * multiplier / cap) * cap, fp32, with
   PyTorch's tanh (the reference's bits), or None (no tanh set, logits not a contiguous bf16/fp32 CPU tensor) */
static PyObject *logit_softcap(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    double num[2];
    if (!op_call("logit_softcap", nargs, 4, (const void *)softcap_kernel) || !numbers(args, 1, 2, num))
        return nullptr;
    const long long threads = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return nullptr;
    const at::Tensor *x = operand(args[0], false, false);
    if (vml_tanh == nullptr || x == nullptr || threads < 1) Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        at::Tensor out = at::empty(x->sizes(), x->options().dtype(at::kFloat));
        const void *xd = x->const_data_ptr();
        float *od = out.mutable_data_ptr<float>();
        const int xb = bf(x);
        const int64_t n = x->numel();
        Py_BEGIN_ALLOW_THREADS
        softcap_kernel(xd, xb, od, n, (float)num[0], (float)num[1], vml_tanh, vml_tanh_mode, (int)threads);
        Py_END_ALLOW_THREADS
        return THPVariable_Wrap(std::move(out));
    });
}

/* A contiguous CPU tensor of `dim` dims (nullptr otherwise). */
static const at::Tensor *plain(PyObject *obj, int64_t dim) {
    if (!THPVariable_Check(obj)) return nullptr;
    const at::Tensor &t = THPVariable_Unpack(obj);
    return t.device().is_cpu() && t.is_contiguous() && t.dim() == dim ? &t : nullptr;
}

/* kv_write_row(k_cache, v_cache, positions, k_new, v_new, slot, position) -> True, or False where it does not apply:
   the decode write of a KV cache layer when every batch row is at one position (musecore.kv_cache): k_new and v_new
   [B, 1, nkv, d] copied into slot `slot` of k_cache and v_cache [B, slots, nkv, d] (contiguous, of their dtype) and
   positions [B, slots] (int64) set to `position` there: one call instead of three narrow copies. */
static PyObject *kv_write_row(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "kv_write_row takes 7 arguments; got %zd", nargs);
        return nullptr;
    }
    const long long slot = PyLong_AsLongLong(args[5]), position = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return nullptr;
    const at::Tensor *kc = plain(args[0], 4), *vc = plain(args[1], 4), *pc = plain(args[2], 2), *kn = plain(args[3], 4),
                     *vn = plain(args[4], 4);
    if (kc == nullptr || vc == nullptr || pc == nullptr || kn == nullptr || vn == nullptr)
        Py_RETURN_FALSE;
    const int64_t B = kc->size(0), slots = kc->size(1);
    if (vc->sizes() != kc->sizes() || vc->scalar_type() != kc->scalar_type() || kn->scalar_type() != kc->scalar_type()
            || vn->scalar_type() != kc->scalar_type() || pc->scalar_type() != at::kLong || pc->size(0) != B
            || pc->size(1) != slots || kn->size(0) != B || kn->size(1) != 1 || kn->size(2) != kc->size(2)
            || kn->size(3) != kc->size(3) || vn->sizes() != kn->sizes() || slot < 0 || slot >= slots)
        Py_RETURN_FALSE;
    const size_t row = (size_t)(kc->size(2) * kc->size(3)) * kc->element_size();
    char *kd = (char *)kc->mutable_data_ptr(), *vd = (char *)vc->mutable_data_ptr();
    const char *ks = (const char *)kn->const_data_ptr(), *vs = (const char *)vn->const_data_ptr();
    int64_t *pd = pc->mutable_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
        memcpy(kd + (size_t)(b * slots + slot) * row, ks + (size_t)b * row, row);
        memcpy(vd + (size_t)(b * slots + slot) * row, vs + (size_t)b * row, row);
        pd[b * slots + slot] = position;
    }
    Py_RETURN_TRUE;
}

/* The routed experts of one MoE layer as musecore_xeon.kernels.moe.XeonExperts describes them (its ctypes copy,
   MoeExpertsArgs): kind 0 INT4 (musecore_int4_moe: gate/up and down codes and their fp16 scale/zero pairs per expert,
   group sizes, padded code rows), 1 BF16 (musecore_bf16_moe: the weights only); the fused call is taken while no
   expert has more than max_tokens routed rows. */
typedef struct {
    int64_t kind;
    const int64_t *gu_w, *gu_sz, *dn_w, *dn_sz;  /* [experts] data pointers each (the sz arrays unused for BF16) */
    int64_t experts, hidden, inter, g_gu, g_dn, gu_rows, dn_rows, max_tokens;
} moe_experts_t;
typedef int (*int4_moe_fn)(const int64_t *, const int64_t *, const int64_t *, const int64_t *, const void *, int,
                           const int64_t *, const float *, const void *, int, float, float *, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int);
typedef int (*bf16_moe_fn)(const int64_t *, const int64_t *, const void *, int, const int64_t *, const float *,
                           const void *, int, float, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int);
static int4_moe_fn int4_moe_kernel;
static bf16_moe_fn bf16_moe_kernel;

/* The fused kernel of x's kind on z [T, h] (bf16 when zb) routed by ids / weights [T, k] -> y fp32 [T, h]; 0, or the
   kernel's nonzero status (no memory for its scratch). Called without the GIL. */
static int run_moe(const moe_experts_t *x, const void *zd, int zb, const int64_t *id, const float *wd, const void *pd,
                   int pb, float post_eps, float *yd, int64_t T, int64_t k, int threads) {
    if (x->kind == 0)
        return int4_moe_kernel(x->gu_w, x->gu_sz, x->dn_w, x->dn_sz, zd, zb, id, wd, pd, pb, post_eps, yd, T, k,
                               x->experts, x->hidden, x->inter, x->g_gu, x->g_dn, x->gu_rows, x->dn_rows, threads);
    return bf16_moe_kernel(x->gu_w, x->dn_w, zd, zb, id, wd, pd, pb, post_eps, yd, T, k, x->experts, x->hidden,
                           x->inter, threads);
}

static PyObject *set_moe(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_moe(int4_moe_address, bf16_moe_address) takes 2 arguments; got %zd", nargs);
        return nullptr;
    }
    void *a = PyLong_AsVoidPtr(args[0]);
    if (PyErr_Occurred()) return nullptr;
    void *b = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return nullptr;
    int4_moe_kernel = (int4_moe_fn)a;
    bf16_moe_kernel = (bf16_moe_fn)b;
    Py_RETURN_NONE;
}

/* moe(experts_address, z, weights, ids, post_norm, post_eps, threads) -> y fp32 [T, h]: the whole moe op of a layer's
   routed experts in one call (checks, the fit test, at::empty, the fused kernel without the GIL), or None where the
   fused call does not apply (z not a contiguous bf16/fp32 [T, h] CPU tensor, weights not fp32 [T, k], ids not int64
   [T, k], post_norm not bf16/fp32 [h], an id outside [0, experts), an expert with more than max_tokens rows): the
   Python path then runs (and raises the errors). */
static PyObject *moe(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "moe takes 7 arguments; got %zd", nargs);
        return nullptr;
    }
    if (int4_moe_kernel == nullptr || bf16_moe_kernel == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "moe: set_moe() was not called with the kernels' addresses");
        return nullptr;
    }
    const moe_experts_t *x = (const moe_experts_t *)PyLong_AsVoidPtr(args[0]);
    if (x == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "moe: the experts' address is null");
        return nullptr;
    }
    const double post_eps = PyFloat_AsDouble(args[5]);
    const long long threads = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return nullptr;
    const at::Tensor *z = operand(args[1], false, false), *w = operand(args[2], true, false),
                     *post = operand(args[4], false, false);
    if (z == nullptr || w == nullptr || post == nullptr || z->dim() != 2 || z->size(1) != x->hidden || z->size(0) == 0
            || w->dim() != 2 || w->size(0) != z->size(0) || w->size(1) == 0 || post->dim() != 1
            || post->size(0) != x->hidden || threads < 1)
        Py_RETURN_NONE;
    const int64_t T = z->size(0), k = w->size(1), E = x->experts;
    const at::Tensor *ids = positions(args[3], T, k);  /* a contiguous int64 [T, k] */
    if (ids == nullptr) Py_RETURN_NONE;
    const int64_t *id = ids->const_data_ptr<int64_t>();
    for (int64_t p = 0; p < T * k; ++p)
        if (id[p] < 0 || id[p] >= E) Py_RETURN_NONE;
    if (T > x->max_tokens) {  /* the fused call runs while every expert has at most max_tokens rows */
        std::vector<int64_t> rows(E, 0);
        for (int64_t p = 0; p < T * k; ++p)
            if (++rows[id[p]] > x->max_tokens) Py_RETURN_NONE;
    }
    return guarded([&]() -> PyObject * {
        at::Tensor y = at::empty({T, x->hidden}, z->options().dtype(at::kFloat));
        const void *zd = z->const_data_ptr(), *pd = post->const_data_ptr();
        const float *wd = w->const_data_ptr<float>();
        float *yd = y.mutable_data_ptr<float>();
        const int zb = bf(z), pb = bf(post);
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = run_moe(x, zd, zb, id, wd, pd, pb, (float)post_eps, yd, T, k, (int)threads);
        Py_END_ALLOW_THREADS
        if (status != 0) {
            PyErr_Format(PyExc_MemoryError, "moe: no memory for the scratch buffers of [%lld, %lld] routed rows",
                         (long long)T, (long long)k);
            return (PyObject *)nullptr;
        }
        return THPVariable_Wrap(std::move(y));
    });
}

/* One MoE block of a layer at decode sizes (musecore_xeon.fused, bound once per layer by Python): the router, the
   pooler GEMV, the pre-expert norm, the fused experts, the fp32 -> bf16 rounding of their sum and the unpooler GEMV,
   each the kernel the separate ops call with the same arguments (the same bits as musecore.model.MoE through the xeon
   ops), in one call with the GIL released: no Python, no tensor per step but the output. */
typedef struct {
    const float *router_w, *router_bias;  /* fp32 [E, H]; [E] or null */
    const void *pooler, *unpooler;        /* the bound GEMV weights (int4_weight_t or bf16_weight_t) */
    int64_t pooler_kind, unpooler_kind;   /* 0 INT4, 1 BF16 */
    const void *pre_norm, *post_norm;     /* [h]: the pre-expert norm's weight, the shared post-expert norm's */
    int64_t pre_norm_bf16, post_norm_bf16;
    const moe_experts_t *experts;
    int64_t hidden, pooled, top_k, max_rows;  /* H, h, k; the most token rows the block is bound for */
    double multiplier, scaling, eps, post_eps;
} moe_block_t;

static inline linear_fn linear_kernel_of(int64_t kind) { return kind == 0 ? int4_linear_kernel : bf16_linear_kernel; }

/* The blocks' scratch: `sizes` pieces of bytes, each 64-byte aligned, carved from one buffer of the calling thread
   (grown when needed, kept for the next call); out[i] is piece i. */
template <size_t N> static void block_scratch(const size_t (&sizes)[N], unsigned char *(&out)[N]) {
    size_t total = 64;
    for (size_t bytes : sizes) total += (bytes + 63) & ~(size_t)63;
    thread_local std::vector<unsigned char> scratch;
    if (scratch.size() < total) scratch.resize(total);
    unsigned char *p = (unsigned char *)(((uintptr_t)scratch.data() + 63) & ~(uintptr_t)63);
    for (size_t i = 0; i < N; ++i) {
        out[i] = p;
        p += (sizes[i] + 63) & ~(size_t)63;
    }
}

/* moe_block(block_address, m, threads) -> the block's output [..., H] bf16 in m's shape, or None where it does not apply
   (m not a contiguous bf16 CPU tensor of [..., H] with 1..max_rows rows, or more rows than an expert may take): the
   Python path then runs. */
static PyObject *moe_block(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!op_call("moe_block", nargs, 3, (const void *)fused_router_kernel)) return nullptr;
    if (int4_moe_kernel == nullptr || int4_linear_kernel == nullptr || rms_kernel == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "moe_block: set_moe()/set_kernels() were not called with the kernels' "
                        "addresses");
        return nullptr;
    }
    const moe_block_t *b = struct_at<moe_block_t>("moe_block", args[0]);
    if (b == nullptr) return nullptr;
    const long long threads = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return nullptr;
    const at::Tensor *m = operand(args[1], false, false);
    if (m == nullptr || m->scalar_type() != at::kBFloat16 || m->size(-1) != b->hidden || threads < 1) Py_RETURN_NONE;
    const int64_t H = b->hidden, h = b->pooled, k = b->top_k, T = m->numel() / H;
    const moe_experts_t *x = b->experts;
    if (T < 1 || T > b->max_rows || T > x->max_tokens) Py_RETURN_NONE;  /* an expert takes <= T rows: one per token */
    return guarded([&]() -> PyObject * {
        /* weights fp32 [T, k], ids int64 [T, k], pooled / z / rounded bf16 [T, h], the experts' sum fp32 [T, h] */
        unsigned char *piece[6];
        block_scratch({(size_t)(T * k * 4), (size_t)(T * k * 8), (size_t)(T * h * 2), (size_t)(T * h * 2),
                       (size_t)(T * h * 2), (size_t)(T * h * 4)}, piece);
        float *weights = (float *)piece[0], *sum = (float *)piece[5];
        int64_t *ids = (int64_t *)piece[1];
        c10::BFloat16 *pooled = (c10::BFloat16 *)piece[2], *z = (c10::BFloat16 *)piece[3],
                      *rounded = (c10::BFloat16 *)piece[4];
        at::Tensor out = at::empty(m->sizes(), m->options());
        const void *md = m->const_data_ptr();
        void *od = out.mutable_data_ptr();
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = fused_router_kernel(md, 1, b->router_w, b->router_bias, T, x->experts, H, k, (float)b->multiplier,
                                     (float)b->scaling, weights, ids, (int)threads);
        if (status == 0) {
            linear_kernel_of(b->pooler_kind)(b->pooler, md, pooled, T, 1);
            rms_kernel(pooled, 1, b->pre_norm, (int)b->pre_norm_bf16, z, 1, T, h, (float)b->eps, 0);
            status = run_moe(x, z, 1, ids, weights, b->post_norm, (int)b->post_norm_bf16, (float)b->post_eps, sum, T,
                             k, (int)threads);
        }
        if (status == 0) {
            for (int64_t i = 0; i < T * h; ++i) rounded[i] = c10::BFloat16(sum[i]);  /* Tensor.to(bfloat16): RNE */
            linear_kernel_of(b->unpooler_kind)(b->unpooler, rounded, od, T, 1);
        }
        Py_END_ALLOW_THREADS
        if (status != 0) {
            PyErr_Format(PyExc_MemoryError, "moe_block: no memory for the scratch buffers of %lld tokens x %lld experts",
                         (long long)T, (long long)k);
            return (PyObject *)nullptr;
        }
        return THPVariable_Wrap(std::move(out));
    });
}

/* One attention block of a layer at decode (musecore_xeon.fused, bound once per layer by Python) for one sequence and
   one new token through a bf16 KV cache layer: the fused q/k/v/gate GEMV, the q/k norms and RoPE (k straight into its
   cache slot), v and the position into theirs, the decode attention over the first `readable` slots, the head norm
   times the gate, and the o_proj GEMV: the kernels of the separate ops with their arguments (the same bits), in one
   call. The cache bookkeeping (slot, capacity, filled slots) stays in Python. */
typedef struct {
    const void *in_proj, *o_proj;    /* the bound GEMV weights (int4_weight_t or bf16_weight_t) */
    int64_t in_kind, o_kind;         /* 0 INT4, 1 BF16 */
    int64_t hidden, nq, nkv, d, window;  /* window <= 0: none */
    double eps, q_scale, scale;
} attention_block_t;

/* attention_block(block_address, a, position, cos | None, sin | None, k_cache, v_cache, pos_cache, slot, readable,
   threads) -> the block's output [1, 1, H] bf16, or None where it does not apply (a not a contiguous bf16 [1, 1, H],
   the cache not bf16 [1, slots, nkv, d] with int64 positions [1, slots], cos/sin not fp32 with d values, a slot or
   readable count outside the cache): the Python path then runs. Nothing is written before every check passed. */
static PyObject *attention_block(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (!op_call("attention_block", nargs, 11, (const void *)attention_kernel)) return nullptr;
    if (int4_linear_kernel == nullptr || rope_kernel == nullptr || gate_kernel == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "attention_block: set_kernels()/set_ops() were not called");
        return nullptr;
    }
    const attention_block_t *b = struct_at<attention_block_t>("attention_block", args[0]);
    if (b == nullptr) return nullptr;
    const long long position = PyLong_AsLongLong(args[2]), slot = PyLong_AsLongLong(args[8]),
                    readable = PyLong_AsLongLong(args[9]), threads = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred()) return nullptr;
    const int64_t H = b->hidden, nq = b->nq, nkv = b->nkv, d = b->d;
    const at::Tensor *a = operand(args[1], false, false);
    if (a == nullptr || a->scalar_type() != at::kBFloat16 || a->numel() != H || a->size(-1) != H || threads < 1
            || position < 0)
        Py_RETURN_NONE;
    bool has_cos, has_sin;
    const at::Tensor *cs = optional_operand(args[3], &has_cos, true), *sn = optional_operand(args[4], &has_sin, true);
    if (has_cos != has_sin || (has_cos && (cs == nullptr || sn == nullptr || cs->numel() != d || sn->numel() != d)))
        Py_RETURN_NONE;
    const at::Tensor *kc = plain(args[5], 4), *vc = plain(args[6], 4), *pc = plain(args[7], 2);
    if (kc == nullptr || vc == nullptr || pc == nullptr || kc->scalar_type() != at::kBFloat16
            || vc->scalar_type() != at::kBFloat16 || pc->scalar_type() != at::kLong || kc->size(0) != 1
            || kc->size(2) != nkv || kc->size(3) != d || vc->sizes() != kc->sizes() || pc->size(0) != 1
            || pc->size(1) != kc->size(1) || slot < 0 || slot >= kc->size(1) || readable <= slot
            || readable > kc->size(1))
        Py_RETURN_NONE;
    return guarded([&]() -> PyObject * {
        const int64_t W = (2 * nq + 2 * nkv) * d;  /* the fused projection: q, k, v, gate */
        /* the projection's output bf16 [W], the normed and rotated q, the attention output, its gated norm [nq, d] */
        unsigned char *piece[4];
        const size_t heads = (size_t)(nq * d * 2);
        block_scratch({(size_t)(W * 2), heads, heads, heads}, piece);
        c10::BFloat16 *y = (c10::BFloat16 *)piece[0], *q = (c10::BFloat16 *)piece[1], *o = (c10::BFloat16 *)piece[2],
                      *g = (c10::BFloat16 *)piece[3];
        at::Tensor out = at::empty(a->sizes(), a->options());
        const void *ad = a->const_data_ptr();
        void *od = out.mutable_data_ptr();
        c10::BFloat16 *kd = (c10::BFloat16 *)kc->mutable_data_ptr(), *vd = (c10::BFloat16 *)vc->mutable_data_ptr();
        int64_t *pd = pc->mutable_data_ptr<int64_t>();
        const float *cp = has_cos ? cs->const_data_ptr<float>() : nullptr, *sp = has_cos ? sn->const_data_ptr<float>() : nullptr;
        const int64_t q_pos = position;
        Py_BEGIN_ALLOW_THREADS
        linear_kernel_of(b->in_kind)(b->in_proj, ad, y, 1, 1);
        rope_kernel(y, 1, nq * d, (float)b->q_scale, cp, sp, q, nq, nq, d, (float)b->eps);
        rope_kernel(y + nq * d, 1, nkv * d, 1.0f, cp, sp, kd + slot * nkv * d, nkv, nkv, d, (float)b->eps);
        memcpy(vd + slot * nkv * d, y + (nq + nkv) * d, (size_t)(nkv * d) * sizeof(c10::BFloat16));
        pd[slot] = position;
        attention_kernel(q, 1, kd, vd, 1, &q_pos, pd, b->window > 0 ? b->window : -1, (float)b->scale, o, 1, 1,
                         readable, nq, nkv, d, (int)threads);
        gate_kernel(o, 1, y + (nq + 2 * nkv) * d, 1, W, g, nq, nq, d, (float)b->eps);
        linear_kernel_of(b->o_kind)(b->o_proj, g, od, 1, 1);
        Py_END_ALLOW_THREADS
        return THPVariable_Wrap(std::move(out));
    });
}

static PyMethodDef methods[] = {
    {"int4_linear", (PyCFunction)(void (*)(void))int4_linear, METH_FASTCALL, "y = x @ W.T for a bound INT4 weight"},
    {"bf16_linear", (PyCFunction)(void (*)(void))bf16_linear, METH_FASTCALL, "y = x @ W.T for a bound BF16 weight"},
    {"set_kernels", (PyCFunction)(void (*)(void))set_kernels, METH_FASTCALL,
     "the addresses of musecore_int4_linear and musecore_bf16_linear"},
    {"set_ops", (PyCFunction)(void (*)(void))set_ops, METH_FASTCALL,
     "the addresses of the norm and router kernels, and the largest input they take"},
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL, "rms_norm(x, w | None, eps, scale_first), or None"},
    {"residual_norm", (PyCFunction)(void (*)(void))residual_norm, METH_FASTCALL,
     "residual_norm(residual, out, post_w | None, alpha, beta, next_w | None, post_eps, eps), or None"},
    {"qk_norm_rope", (PyCFunction)(void (*)(void))qk_norm_rope, METH_FASTCALL,
     "qk_norm_rope(q, k, cos | None, sin | None, eps, q_scale), or None"},
    {"head_norm_gate", (PyCFunction)(void (*)(void))head_norm_gate, METH_FASTCALL,
     "head_norm_gate(o, gate_logits, eps), or None"},
    {"router_topk", (PyCFunction)(void (*)(void))router_topk, METH_FASTCALL,
     "router_topk(logits, bias | None, k, multiplier, scaling) -> (weights, ids), or None"},
    {"attention", (PyCFunction)(void (*)(void))attention, METH_FASTCALL,
     "attention(q, k, v, q_pos, k_pos, window, scale, threads), or None"},
    {"router", (PyCFunction)(void (*)(void))router, METH_FASTCALL,
     "router(x, weight, bias | None, k, multiplier, scaling, threads) -> (weights, ids), or None"},
    {"logit_softcap", (PyCFunction)(void (*)(void))logit_softcap, METH_FASTCALL,
     "logit_softcap(logits, multiplier, cap, threads), or None"},
    {"kv_write_row", (PyCFunction)(void (*)(void))kv_write_row, METH_FASTCALL,
     "kv_write_row(k_cache, v_cache, positions, k_new, v_new, slot, position) -> True, or False"},
    {"set_tanh", (PyCFunction)(void (*)(void))set_tanh, METH_FASTCALL, "the address and mode of PyTorch's tanh kernel"},
    {"set_moe", (PyCFunction)(void (*)(void))set_moe, METH_FASTCALL,
     "the addresses of musecore_int4_moe and musecore_bf16_moe"},
    {"attention_block", (PyCFunction)(void (*)(void))attention_block, METH_FASTCALL,
     "attention_block(block_address, a, position, cos, sin, k, v, positions, slot, readable, threads), or None"},
    {"moe_block", (PyCFunction)(void (*)(void))moe_block, METH_FASTCALL,
     "moe_block(block_address, m, threads): a layer's MoE block at decode sizes in one call, or None"},
    {"moe", (PyCFunction)(void (*)(void))moe, METH_FASTCALL,
     "moe(experts_address, z, weights, ids, post_norm, post_eps, threads) -> y fp32 [T, h], or None"},
    {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "musecore_xeon_binding", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_musecore_xeon_binding(void) { return PyModule_Create(&module); }
