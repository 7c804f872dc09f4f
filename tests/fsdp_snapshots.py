"""Hand-built CUDA memory snapshots of FSDP2 / FSDP1 training (CPU runs cannot record one).

They have the exact shape ``torch.cuda.memory._snapshot()`` writes (torch/cuda/memory.py, as the real
pickles in ../shared/data/cuda-snapshots show it): ``segments`` (device, address, total_size,
allocated_size, active_size, requested_size, stream, segment_type, segment_pool_id, is_expandable,
frames, blocks with address / size / requested_size / state / frames), ``device_traces`` (entries with
action, addr, size, stream, time_us, compile_context, user_metadata, frames; ``oom`` entries with
device_free), ``allocator_settings`` and ``external_annotations``.  A small caching allocator lays the
blocks out (512 B rounding, 2 MiB small-pool and 20 MiB / 2 MiB-rounded large-pool segments, best-fit
splitting, merging on free) so addresses are reused as on a GPU.

Stacks are what ``_record_memory_history(stacks="all")`` records: the allocator's C++ frames, the op's,
then the Python frames innermost first.  The FSDP frames are torch 2.13's own: the function, file and
line of each call are read from the installed torch source (``inspect``), following the code paths of
fully_shard (FSDPState._pre_forward -> FSDPParamGroup.pre_forward -> unshard -> foreach_all_gather ->
allocate; wait_for_unshard -> foreach_all_gather_copy_out -> alloc_all_gather_outputs -> alloc_storage;
post_backward -> foreach_reduce -> allocate) and FSDP1 (FullyShardedDataParallel.forward -> _pre_forward
-> _pre_forward_unshard -> _unshard -> FlatParamHandle.unshard -> _alloc_padded_unsharded_flat_param ->
_alloc_storage; _post_backward_hook -> _reduce_grad -> _get_reduce_scatter_tensors).  The model (a
Llama-style transformer, torchtitan's layout: the root holds the embedding, final norm and output) and
training script are ours, so their frames are made up.

Every allocation carries its truth (category, unit) on the side, for the tests to compare with.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch.distributed.fsdp._fully_shard._fsdp_collectives as f2c
import torch.distributed.fsdp._fully_shard._fsdp_common as f2common
import torch.distributed.fsdp._fully_shard._fsdp_param as f2p
import torch.distributed.fsdp._fully_shard._fsdp_param_group as f2g
import torch.distributed.fsdp._fully_shard._fsdp_state as f2s
import torch.distributed.fsdp._flat_param as f1flat
import torch.distributed.fsdp._runtime_utils as f1rt
import torch.distributed.fsdp.fully_sharded_data_parallel as f1fsdp
import torch.distributed.utils as dist_utils
import torch.nn.modules.module as module_mod
import torch.optim.adam as adam
import torch.optim.optimizer as optimizer_mod
import torch.utils._contextlib as contextlib_mod
import torch._dynamo.eval_frame as eval_frame

MIB = 1 << 20
MODEL_PY = "/workspace/torchtitan/torchtitan/models/llama3/model/model.py"
TRAIN_PY = "/workspace/torchtitan/torchtitan/train.py"
LOSS_PY = "/workspace/torchtitan/torchtitan/components/loss.py"


# --------------------------------------------------------------------------- frames
def _src(fn):
    fn = inspect.unwrap(fn)
    lines, start = inspect.getsourcelines(fn)
    return inspect.getsourcefile(fn), lines, start


def tframe(fn, needle: str, name: str | None = None, after: str | None = None) -> dict:
    """The frame of ``fn`` (a torch function) at the first line containing ``needle`` (after the line
    containing ``after``): {name, filename, line} as the snapshot records it."""
    path, lines, start = _src(fn)
    i0 = 0
    if after:
        i0 = next(i for i, ln in enumerate(lines) if after in ln)
    i = next(i for i, ln in enumerate(lines) if i >= i0 and needle in ln)
    return {"name": name or inspect.unwrap(fn).__name__, "filename": path, "line": start + i}


def pyframe(name: str, filename: str, line: int) -> dict:
    return {"name": name, "filename": filename, "line": line}


def cframe(name: str, filename: str = "??") -> dict:
    return {"name": name, "filename": filename, "line": 0}


ALLOC_PREFIX = [
    cframe("torch::unwind::unwind()"), cframe("torch::CapturedTraceback::gather(bool, bool, bool)"),
    cframe("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp"),
    cframe("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, "
           "CUstream_st*)", "CUDACachingAllocator.cpp"),
    cframe("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(void**, signed char, unsigned "
           "long, CUstream_st*)", ""),
    cframe("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)", ""),
]
FREE_PREFIX = [cframe("torch::unwind::unwind()"), cframe("torch::CapturedTraceback::gather(bool, bool, bool)"),
               cframe("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp"),
               cframe("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::free(c10::cuda::"
                      "CUDACachingAllocator::Block*)", "CUDACachingAllocator.cpp")]
EMPTY_OP = [cframe("c10::StorageImpl::StorageImpl(c10::StorageImpl::use_byte_size_t, c10::SymInt const&, "
                   "c10::Allocator*, bool)", ""),
            cframe("at::detail::empty_cuda(c10::ArrayRef<long>, c10::TensorOptions const&)"),
            cframe("at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>, std::optional<c10::ScalarType>, "
                   "std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, "
                   "std::optional<c10::MemoryFormat>)"),
            cframe("torch::autograd::THPVariable_empty(_object*, _object*, _object*)", "python_torch_functions.cpp")]
RESIZE_OP = [cframe("at::native::resize_bytes_cuda(c10::StorageImpl*, unsigned long)", "Resize.cpp"),
             cframe("THPStorage_resize_(_object*, _object*)", "StorageMethods.cpp")]
MM_OP = [cframe("at::detail::empty_cuda(c10::ArrayRef<long>, c10::TensorOptions const&)"),
         cframe("at::(anonymous namespace)::wrapper_CUDA_mm(at::Tensor const&, at::Tensor const&)", "RegisterCUDA_0.cpp"),
         cframe("at::_ops::mm::call(at::Tensor const&, at::Tensor const&)"),
         cframe("at::native::linear(at::Tensor const&, at::Tensor const&, std::optional<at::Tensor> const&)"),
         cframe("torch::autograd::THPVariable_linear(_object*, _object*, _object*)", "python_nn_functions.cpp")]
MAIN_TAIL = [cframe("_PyEval_EvalFrameDefault"), cframe("PyEval_EvalCode"), cframe("Py_BytesMain"),
             cframe("__libc_start_main"), cframe("_start")]
ENGINE = [cframe("torch::autograd::Node::operator()(std::vector<at::Tensor, std::allocator<at::Tensor> >&&)"),
          cframe("torch::autograd::call_function(std::shared_ptr<torch::autograd::GraphTask>&, "
                 "torch::autograd::Node*, torch::autograd::InputBuffer&)", "engine.cpp"),
          cframe("torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::GraphTask>&, "
                 "torch::autograd::Node*, torch::autograd::InputBuffer&, std::shared_ptr<torch::autograd::"
                 "ReadyQueue> const&)", "engine.cpp"),
          cframe("torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)",
                 "engine.cpp"),
          cframe("torch::autograd::Engine::thread_init(int, std::shared_ptr<torch::autograd::ReadyQueue> const&, "
                 "bool)", "engine.cpp"),
          cframe("torch::autograd::python::PythonEngine::thread_init(int, std::shared_ptr<torch::autograd::"
                 "ReadyQueue> const&, bool)", "python_engine.cpp"),
          cframe("execute_native_thread_routine"), cframe("start_thread", "pthread_create.c"), cframe("clone")]


class Frames:
    """The call chains of an FSDP training step, torch's frames from the installed source."""

    def __init__(self):
        M = module_mod.Module
        self.call_impl_hook = tframe(M._call_impl, "args_kwargs_result = hook(self, args, kwargs)")
        self.call_impl_fwd = tframe(M._call_impl, "result = forward_call(*args, **kwargs)")
        self.call_impl_fast = tframe(M._call_impl, "return forward_call(*args, **kwargs)")
        self.wrapped = tframe(M._wrapped_call_impl, "return self._call_impl(*args, **kwargs)")
        self.no_grad = tframe(contextlib_mod.context_decorator, "return func(*args, **kwargs)", name="decorate_context")
        self.dyn_wrapper = tframe(f2common._dynamo_disable, ")(*args, **kwargs)", name="wrapper")
        self.dyn_fn = {"name": "_fn", "filename": inspect.getsourcefile(eval_frame),
                       "line": _first_line(eval_frame, "return fn(*args, **kwargs)", after="class DisableContext")}
        S, G, C, P = f2s.FSDPState, f2g.FSDPParamGroup, f2c, f2p
        self.group_pre_hook = tframe(f2s._register_group_forward_hooks, "return pre_hook(*args, **kwargs)",
                                     name="wrapped_pre_hook")
        self.pre_forward_state = tframe(S._pre_forward, "args, kwargs = fsdp_param_group.pre_forward(module, args, kwargs)")
        self.pre_forward_group_unshard = tframe(G.pre_forward, "self.unshard(self.unshard_async_op)")
        self.pre_forward_group_wait = tframe(G.pre_forward, "self.wait_for_unshard()")
        self.unshard = tframe(G.unshard, "self._all_gather_result = foreach_all_gather(")
        self.foreach_ag_out = tframe(C.foreach_all_gather, "all_gather_output = all_gather_comm.allocate(")
        self.foreach_ag_in = tframe(C.foreach_all_gather, "param_all_gather_inputs = _get_param_all_gather_inputs(")
        self.get_inputs = tframe(C._get_param_all_gather_inputs, "flat_foreach_copy_input = torch.empty(")
        self.allocate = tframe(C.DefaultAllocMixin.allocate, "return torch.empty(")
        self.wait_copy_out = tframe(G.wait_for_unshard, "foreach_all_gather_copy_out(")
        self.wait_free = tframe(G.wait_for_unshard, "self._all_gather_result = None")
        self.copy_out = tframe(C.foreach_all_gather_copy_out, "fsdp_param.alloc_all_gather_outputs()")
        self.alloc_outputs = tframe(P.FSDPParam.alloc_all_gather_outputs, "alloc_storage(tensor)")
        self.alloc_storage = tframe(P.alloc_storage, "storage.resize_(size)")
        self.free_storage = tframe(P.free_storage, "storage.resize_(0)")
        self.free_unsharded = tframe(P.FSDPParam.free_unsharded_param, "free_storage(tensor)")
        self.to_sharded = tframe(P.FSDPParam.to_sharded, "self.free_unsharded_param()")
        self.group_to_sharded = tframe(G._to_sharded, "fsdp_param.to_sharded()")
        self.reshard = tframe(G.reshard, "self._to_sharded()")
        self.post_forward_group = tframe(G.post_forward, "self.reshard()")
        self.post_forward_state = tframe(S._post_forward, "output = fsdp_param_group.post_forward(module, input, output)")
        self.pre_backward_state = tframe(S._pre_backward, "fsdp_param_group.pre_backward(default_prefetch)")
        self.pre_backward_group_wait = tframe(G.pre_backward, "self.wait_for_unshard()")
        self.pre_backward_group_prefetch = tframe(G.pre_backward, "self._backward_prefetch()")
        self.backward_prefetch = tframe(G._backward_prefetch, "self._prefetch_unshard(target, \"backward\")",
                                        after="elif curr_index > 0")
        self.prefetch_unshard = tframe(G._prefetch_unshard, "target_fsdp_param_group.unshard(async_op)")
        self.pre_bwd_fn = tframe(f2s.RegisterPreBackwardFunction.backward, "return None, ctx.state._pre_backward(grad)")
        self.post_bwd_fn = tframe(f2g.RegisterPostBackwardFunction.backward, "ctx.param_group.post_backward()")
        self.post_backward_reshard = tframe(G.post_backward, "self.reshard()", after="if self.reshard_after_backward:")
        self.post_backward_reduce = tframe(G.post_backward, ") = foreach_reduce(")
        self.reduce_in = tframe(C.foreach_reduce, "reduce_scatter_input = reduce_scatter_comm.allocate(")
        self.reduce_out = tframe(C.foreach_reduce, "reduce_output = reduce_scatter_comm.allocate(")
        self.reduce_clear = tframe(C.foreach_reduce, "unsharded_grads.clear()")
        self.autograd_apply = tframe(_autograd_function_apply(), "return user_fn(self, *args)")
        # FSDP1
        self.f1_forward = tframe(f1fsdp.FullyShardedDataParallel.forward, "args, kwargs = _pre_forward(")
        self.f1_forward_body = tframe(f1fsdp.FullyShardedDataParallel.forward, "output = self._fsdp_wrapped_module(")
        self.f1_forward_post = tframe(f1fsdp.FullyShardedDataParallel.forward, "return _post_forward(")
        self.f1_pre_forward = tframe(f1rt._pre_forward, "unshard_fn(state, handle)")
        self.f1_pre_forward_unshard = tframe(f1rt._pre_forward_unshard, "_unshard(state, handle, state._unshard_stream")
        self.f1_unshard = tframe(f1rt._unshard, "handle.unshard()")
        self.f1_handle_unshard = tframe(f1flat.FlatParamHandle.unshard, "unsharded_flat_param = self._alloc_padded_unsharded_flat_param()")
        self.f1_alloc_padded = tframe(f1flat.FlatParamHandle._alloc_padded_unsharded_flat_param, "_alloc_storage(")
        self.f1_alloc_storage = tframe(dist_utils._alloc_storage, "tensor._typed_storage()._resize_(size.numel())")
        self.f1_free_storage = tframe(dist_utils._free_storage, "tensor._typed_storage()._resize_(0)")
        self.f1_free_unsharded = tframe(f1flat.FlatParamHandle._free_unsharded_flat_param, "_free_storage(unsharded_flat_param)")
        self.f1_reshard = tframe(f1flat.FlatParamHandle.reshard, "self._free_unsharded_flat_param()")
        self.f1_rt_reshard = tframe(f1rt._reshard, "handle.reshard(free_unsharded_flat_param)")
        self.f1_post_forward = tframe(f1rt._post_forward, "reshard_fn(state, handle)")
        self.f1_post_forward_reshard = tframe(f1rt._post_forward_reshard, "_reshard(state, handle, free_unsharded_flat_param)")
        self.f1_pre_backward = tframe(f1rt._pre_backward_hook, "_prefetch_handle(state, handle, _PrefetchMode.BACKWARD)")
        self.f1_prefetch = tframe(f1rt._prefetch_handle, "_unshard(state, handle, state._unshard_stream, state._pre_unshard_stream)")
        self.f1_post_backward = tframe(f1rt._post_backward_hook, "_reduce_grad(state, handle)")
        self.f1_reduce_grad = tframe(f1rt._reduce_grad, "padded_unsharded_grad, new_sharded_grad = _get_reduce_scatter_tensors(")
        self.f1_rs_tensors = tframe(f1rt._get_reduce_scatter_tensors, "new_sharded_grad = torch.empty_like(chunks[0])")
        self.adamw = tframe(adam._multi_tensor_adam, "_foreach_sqrt(")
        self.opt_step = tframe(adam.Adam.step, "adam(")
        self.init_group = tframe(adam.Adam._init_group, "torch.zeros_like(")
        self.opt_wrapper = tframe(optimizer_mod.Optimizer.profile_hook_step, "out = func(*args, **kwargs)", name="wrapper")
        self.zero_grad = tframe(optimizer_mod.Optimizer.zero_grad, "p.grad = None")


def _first_line(mod, needle: str, after: str) -> int:
    lines = inspect.getsource(mod).splitlines()
    i0 = next(i for i, ln in enumerate(lines) if after in ln)
    return next(i for i, ln in enumerate(lines) if i >= i0 and needle in ln) + 1


def _autograd_function_apply():
    import torch.autograd.function as af
    return af.BackwardCFunction.apply


# --------------------------------------------------------------------------- caching allocator
@dataclass
class _Block:
    addr: int
    size: int
    seg: int
    free: bool = True
    requested: int = 0
    frames: list = field(default_factory=list)


class Allocator:
    """A small model of the CUDA caching allocator: rounding, pools, best fit, splitting, merging."""

    def __init__(self, base: int = 0x7F0000000000):
        self.base = base
        self.next_addr = base
        self.segs: list[dict] = []          # address, size, stream, pool, blocks (address-ordered list)
        self.live: dict[int, _Block] = {}

    @staticmethod
    def round(n: int) -> int:
        return 512 if n < 512 else 512 * math.ceil(n / 512)

    def malloc(self, n: int, stream: int, frames: list, record) -> _Block:
        size = self.round(n)
        pool = "small" if size <= MIB else "large"
        best = None
        for si, s in enumerate(self.segs):
            if s["pool"] != pool or s["stream"] != stream or s.get("released"):
                continue
            for b in s["blocks"]:
                if b.free and b.size >= size and (best is None or b.size < best.size):
                    best = b
        if best is None:
            seg_size = 2 * MIB if pool == "small" else (20 * MIB if size < 10 * MIB else 2 * MIB * math.ceil(size / (2 * MIB)))
            addr = self.next_addr
            self.next_addr += seg_size + 2 * MIB
            seg = {"address": addr, "size": seg_size, "stream": stream, "pool": pool, "blocks": [], "frames": frames}
            best = _Block(addr, seg_size, len(self.segs))
            seg["blocks"].append(best)
            self.segs.append(seg)
            record({"action": "segment_alloc", "addr": addr, "size": seg_size, "stream": stream, "frames": frames})
        rest = best.size - size
        if rest >= (512 if pool == "small" else MIB + 1):
            seg = self.segs[best.seg]
            i = seg["blocks"].index(best)
            seg["blocks"].insert(i + 1, _Block(best.addr + size, rest, best.seg))
            best.size = size
        best.free, best.requested, best.frames = False, n, frames
        self.live[best.addr] = best
        return best

    def release(self, addr: int) -> _Block:
        b = self.live.pop(addr)
        b.free = True
        seg = self.segs[b.seg]["blocks"]
        i = seg.index(b)
        if i + 1 < len(seg) and seg[i + 1].free:
            b.size += seg.pop(i + 1).size
        if i > 0 and seg[i - 1].free:
            seg[i - 1].size += seg.pop(i).size
        return b

    def empty_cache(self, record) -> None:
        """cudaFree every segment whose blocks are all free (``torch.cuda.empty_cache()``)."""
        for s in self.segs:
            if not s.get("released") and all(b.free for b in s["blocks"]):
                s["released"] = True
                record({"action": "segment_free", "addr": s["address"], "size": s["size"], "stream": s["stream"],
                        "frames": []})

    def segments(self, device: int) -> list[dict]:
        out = []
        for s in (s for s in self.segs if not s.get("released")):
            blocks = [{"address": b.addr, "size": b.size, "requested_size": b.requested if not b.free else 0,
                       "state": "inactive" if b.free else "active_allocated", "frames": [] if b.free else b.frames}
                      for b in s["blocks"]]
            alloc = sum(b["size"] for b in blocks if b["state"] != "inactive")
            out.append({"device": device, "address": s["address"], "total_size": s["size"], "allocated_size": alloc,
                        "active_size": alloc, "requested_size": sum(b["requested_size"] for b in blocks),
                        "stream": s["stream"], "segment_type": s["pool"], "segment_pool_id": (0, 0),
                        "is_expandable": False, "frames": s["frames"], "blocks": blocks})
        return out


# --------------------------------------------------------------------------- the recording
def _main_thread(frames: list) -> list:
    """A stack of the main thread as torch's unwinder gives it: the native frames down to ``_start``, then
    the Python frames (innermost first).  Stacks of the autograd engine's threads are left as they are."""
    if any(f["name"] == "start_thread" for f in frames):
        return frames
    i = next((k for k, f in enumerate(frames) if f["filename"].endswith(".py")), None)
    return frames if i is None else frames[:i] + MAIN_TAIL + frames[i:]


class Recorder:
    """Trace entries + allocator + the truth of every allocation."""

    def __init__(self, device: int = 0, t0: int = 1_760_000_000_000_000):
        self.device = device
        self.t = t0
        self.trace: list[dict] = []
        self.al = Allocator()
        self.recording = False
        self.truth: list[dict] = []         # one per allocation: seq, addr, bytes, category, unit, free_seq

    def _entry(self, e: dict) -> None:
        if not self.recording:
            return
        self.t += 7
        e.setdefault("stream", 0)
        e["time_us"] = self.t
        e["compile_context"] = "N/A"
        e.setdefault("user_metadata", "")
        self.trace.append(e)

    def alloc(self, n: int, frames: list, category: str, unit: str | None, stream: int = 0) -> int:
        fr = _main_thread(frames) if self.recording else []
        b = self.al.malloc(n, stream, fr, self._entry)
        seq = len(self.trace) if self.recording else -1
        self._entry({"action": "alloc", "addr": b.addr, "size": n, "stream": stream, "frames": fr})
        self.truth.append({"seq": seq, "addr": b.addr, "bytes": n, "category": category, "unit": unit,
                           "free_seq": None, "stream": stream})
        return b.addr

    def free(self, addr: int, frames: list) -> None:
        frames = _main_thread(frames)
        b = self.al.release(addr)
        t = next(x for x in reversed(self.truth) if x["addr"] == addr and x["free_seq"] is None)
        t["free_seq"] = len(self.trace)
        self._entry({"action": "free_requested", "addr": addr, "size": t["bytes"], "stream": t["stream"], "frames": frames})
        self._entry({"action": "free_completed", "addr": addr, "size": t["bytes"], "stream": t["stream"], "frames": frames})
        assert b.addr == addr

    def oom(self, n: int, frames: list, device_free: int) -> int:
        self._entry({"action": "oom", "addr": 0, "size": n, "device_free": device_free, "stream": 0, "frames": frames})
        return len(self.trace) - 1

    def snapshot(self) -> dict:
        return {"segments": self.al.segments(self.device), "device_traces": [self.trace],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                       "garbage_collection_threshold": 0.0, "expandable_segments": False},
                "external_annotations": []}


# --------------------------------------------------------------------------- the model and its step
@dataclass
class Model:
    """A Llama-style transformer sharded by FSDP: root (embedding, norm, output) + n_layers blocks."""

    n_layers: int = 8
    dim: int = 4096
    hidden: int = 14336
    n_heads: int = 32
    kv_dim: int = 1024
    vocab: int = 128256
    world: int = 4
    batch: int = 2
    seq: int = 4096
    gather_bytes: int = 2          # bf16 all-gathers (mixed precision), fp32 storage and reduce
    family: str = "fsdp2"
    # torchtitan's layout: fully_shard(tok_embeddings) (unit 0), each block, fully_shard([model.norm, model.output]):
    # the final norm and the output projection one FSDP2 unit of two modules (the last, unit n_layers + 1: gathered in
    # the norm's pre-forward through FSDP2's group hook, not resharded after forward); the root holds no parameter
    tail_unit: bool = False

    @property
    def n_units(self) -> int:
        return self.n_layers + 1 + (1 if self.tail_unit else 0)

    def layer_params(self) -> list[tuple[int, ...]]:
        d, h, kv = self.dim, self.hidden, self.kv_dim
        return [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (h, d), (d, h), (h, d)]

    def root_params(self) -> list[tuple[int, ...]]:
        return [(self.vocab, self.dim)] + ([] if self.tail_unit else self.tail_params())

    def tail_params(self) -> list[tuple[int, ...]]:
        """The final norm and the output projection."""
        return [(self.dim,), (self.vocab, self.dim)]

    def unit_params(self, k: int) -> list[tuple[int, ...]]:
        if k == 0:
            return self.root_params()
        return self.tail_params() if self.tail_unit and k == self.n_layers + 1 else self.layer_params()

    def shard_numel(self, shape: tuple[int, ...]) -> int:
        """FSDP2 pads dim 0 to a multiple of the world size: the numel of one rank's shard."""
        rest = math.prod(shape[1:])
        return math.ceil(shape[0] / self.world) * rest

    def flat_shard_numel(self, k: int) -> int:
        """FSDP1: one flat parameter per unit, padded to a multiple of the world size."""
        n = sum(math.prod(s) for s in self.unit_params(k))
        return math.ceil(n / self.world)


OOM_IN_LOSS = "loss"     # build(oom_layer=OOM_IN_LOSS): the step dies in the loss, after the model's forward


def unit_label(k: int) -> str:
    return f"unit {k}"


def build(model: Model | None = None, *, steps: int = 2, oom_layer: int | None = None, device_free: int = 3 * MIB,
          history_from_start: bool = False) -> tuple[dict, list[dict], dict]:
    """Simulate ``steps`` training steps of ``model`` under FSDP (model.family) and return (snapshot,
    truth, info).  The history starts after the model and the optimizer state were created (as when
    ``_record_memory_history`` is turned on at the first profiled step) unless ``history_from_start``.
    ``oom_layer``: the last step fails in the forward of that layer (an OOM entry, then the frees of the
    exception's unwinding; ``info["segments_at_oom"]``: the allocator's segments when it failed)."""
    m = model or Model()
    F = Frames()
    rec = Recorder()
    assert m.family == "fsdp2" or not m.tail_unit, "FSDP1 wraps one module per unit"
    n_units = m.n_units
    info = {"oom_seq": None, "units": [unit_label(k) for k in range(n_units)]}
    sharded: dict[int, list[int]] = {}
    rec.recording = history_from_start
    # model init: the shards, fp32 (FSDP2: one per parameter; FSDP1: one flat parameter per unit)
    init_fr = [tframe(f2p.FSDPParam._init_sharded_param, "padded_sharded_param = param_data.new_zeros(")]
    for k in range(n_units):
        shapes = m.unit_params(k) if m.family == "fsdp2" else [(m.flat_shard_numel(k),)]
        for s in shapes:
            n = (m.shard_numel(s) if m.family == "fsdp2" else s[0]) * 4
            sharded.setdefault(k, []).append(rec.alloc(n, ALLOC_PREFIX + init_fr, "sharded_param", unit_label(k)))
    # the RoPE table (a buffer of the root module)
    rec.alloc(m.seq * m.dim // m.n_heads * 8, ALLOC_PREFIX, "other", None)
    # optimizer state: AdamW's exp_avg and exp_avg_sq per shard
    opt_fr = [pyframe("_init_group", inspect.getsourcefile(adam), 150)]
    for k in range(n_units):
        for _ in range(2):
            shapes = m.unit_params(k) if m.family == "fsdp2" else [(m.flat_shard_numel(k),)]
            for s in shapes:
                n = (m.shard_numel(s) if m.family == "fsdp2" else s[0]) * 4
                rec.alloc(n, ALLOC_PREFIX + opt_fr, "optimizer_state", unit_label(k))
    rec.recording = True
    for step in range(steps):
        oom = oom_layer if step == steps - 1 else None
        dead = _step(m, F, rec, oom, device_free, info)
        if dead:
            break
    return rec.snapshot(), rec.truth, info


def _main_chain(F: Frames, step_line: int) -> list[dict]:
    return [pyframe("forward_backward_step", TRAIN_PY, step_line), pyframe("train_step", TRAIN_PY, 520),
            pyframe("train", TRAIN_PY, 610), pyframe("<module>", TRAIN_PY, 700)]


def _root_call(F: Frames, hook: bool) -> list[dict]:
    """Frames of the root module's call from the training loop (hook: from its pre-forward hook; FSDP1
    has no hooks: FullyShardedDataParallel.forward is the module's forward)."""
    return [F.call_impl_hook if hook else F.call_impl_fwd, F.wrapped] + _main_chain(F, 455)


def _step(m: Model, F: Frames, rec: Recorder, oom_layer, device_free, info) -> bool:
    """One training step (FSDP2 or FSDP1); True when it died of an OOM."""
    f2 = m.family == "fsdp2"
    gb, W, L = m.gather_bytes, m.world, m.n_layers
    n_units = m.n_units
    bsd = m.batch * m.seq * m.dim * gb
    bsh = m.batch * m.seq * m.hidden * gb
    state = {"ag_flat": {}, "unsharded": {}, "deferred": None, "acts": {}, "grads": {}, "rs_in": [], "sharded_grads": []}
    fsdp_hook = [F.dyn_fn, F.dyn_wrapper]

    def unit_shapes(k):
        return m.unit_params(k)

    def gather(k: int, chain: list, in_backward: bool):
        """unshard(k): the all-gather (FSDP2: input + flat output on the copy-in stream)."""
        u = unit_label(k)
        if f2:
            chain = [F.unshard] + chain
            shard_numels = [m.shard_numel(s) for s in unit_shapes(k)]
            a_in = rec.alloc(sum(shard_numels) * gb, ALLOC_PREFIX + EMPTY_OP + [F.get_inputs, F.no_grad, F.foreach_ag_in,
                                                                               F.no_grad] + chain,
                             "temporary", u, stream=1)
            out = rec.alloc(sum(shard_numels) * W * gb, ALLOC_PREFIX + EMPTY_OP + [F.allocate, F.foreach_ag_out, F.no_grad]
                            + chain, "unsharded_param", u, stream=1)
            rec.free(a_in, FREE_PREFIX + [F.no_grad] + chain)
            state["ag_flat"][k] = out
        else:
            n = m.flat_shard_numel(k) * W * gb
            out = rec.alloc(n, ALLOC_PREFIX + RESIZE_OP + [F.f1_alloc_storage, F.f1_alloc_padded, F.f1_handle_unshard,
                                                          F.f1_unshard] + chain, "unsharded_param", u)
            state["unsharded"][k] = [out]

    def copy_out(k: int, chain: list, in_backward: bool):
        """wait_for_unshard(k) (FSDP2): per-parameter unsharded tensors, then the flat output is freed
        (forward: at the next unit's wait_for_unshard, before its copy-out)."""
        if not f2:
            return
        u = unit_label(k)
        wchain = [F.wait_copy_out] + chain
        if state["deferred"] is not None:
            rec.free(state["ag_flat"].pop(state["deferred"]), FREE_PREFIX + [F.wait_copy_out] + chain)
            state["deferred"] = None
        outs = []
        for s in unit_shapes(k):
            outs.append(rec.alloc(m.shard_numel(s) * W * gb, ALLOC_PREFIX + RESIZE_OP + [F.alloc_storage, F.alloc_outputs,
                                                                                        F.copy_out, F.no_grad] + wchain,
                                  "unsharded_param", u))
        state["unsharded"][k] = outs
        if in_backward:
            rec.free(state["ag_flat"].pop(k), FREE_PREFIX + [F.wait_free] + chain)
        else:
            state["deferred"] = k

    def reshard(k: int, chain: list):
        fr = FREE_PREFIX + ([F.free_storage, F.free_unsharded, F.to_sharded, F.group_to_sharded] if f2 else
                            [F.f1_free_storage, F.f1_free_unsharded, F.f1_reshard, F.f1_rt_reshard]) + chain
        for a in state["unsharded"].pop(k):
            rec.free(a, fr)

    def pre_forward(k: int, call: list):
        if f2:
            chain = [F.pre_forward_group_unshard, F.pre_forward_state] + fsdp_hook + call
            gather(k, chain, False)
            copy_out(k, [F.pre_forward_group_wait, F.pre_forward_state] + fsdp_hook + call, False)
        else:
            gather(k, [F.f1_pre_forward_unshard, F.f1_pre_forward, F.f1_forward] + call, False)

    def act(k, n, where: list, category="activation"):
        a = rec.alloc(n, ALLOC_PREFIX + MM_OP + where, category, unit_label(k) if k is not None else None)
        state["acts"].setdefault(k, []).append(a)
        return a

    def die(n: int, frames: list, unit) -> bool:
        """An OOM requesting ``n`` bytes, then the exception unwinds: everything of the step is freed."""
        info["oom_seq"] = rec.oom(n, frames, device_free)
        info["oom_unit"] = unit
        info["segments_at_oom"] = rec.al.segments(rec.device)     # the allocator's state when it failed
        for kk in list(state["acts"]):
            for a in state["acts"].pop(kk):
                rec.free(a, FREE_PREFIX)
        for kk in list(state["unsharded"]):
            for a in state["unsharded"].pop(kk):
                rec.free(a, FREE_PREFIX)
        for kk in list(state["ag_flat"]):
            rec.free(state["ag_flat"].pop(kk), FREE_PREFIX)
        return True

    def temp(k, n, where: list):
        a = rec.alloc(n, ALLOC_PREFIX + MM_OP + where, "temporary", unit_label(k) if k is not None else None)
        rec.free(a, FREE_PREFIX + where)

    # ---------------- forward
    root_hook = _root_call(F, f2)
    if not m.tail_unit:
        pre_forward(0, root_hook)
    # FSDP1 wraps each module: FullyShardedDataParallel.forward calls the wrapped module
    inner = (lambda call: [F.call_impl_fast, F.wrapped, F.f1_forward_body] + call) if not f2 else (lambda call: call)
    root_body = [pyframe("forward", MODEL_PY, 470)] + inner(_root_call(F, False))

    def layer_call(hook: bool) -> list:
        """layer k's call from the root's forward (``for layer in self.layers.values(): h = layer(h)``)"""
        return [F.call_impl_hook if hook else F.call_impl_fwd, F.wrapped, pyframe("forward", MODEL_PY, 480)] + root_body[1:]

    sparse_py = pyframe("forward", "/usr/lib/python3.11/site-packages/torch/nn/modules/sparse.py", 192)
    if m.tail_unit:     # torchtitan: the embedding is a unit of its own (the root holds no parameter)
        emb_at = pyframe("forward", MODEL_PY, 468)
        pre_forward(0, [F.call_impl_hook, F.wrapped, emb_at] + root_body[1:])
        act(0, bsd, [sparse_py, F.call_impl_fwd, F.wrapped, emb_at] + root_body[1:])
        reshard(0, [F.post_forward_group, F.post_forward_state] + fsdp_hook
                + [F.call_impl_hook, F.wrapped, emb_at] + root_body[1:])
    else:
        act(0, bsd, [sparse_py, F.call_impl_fast, F.wrapped] + root_body)
    for k in range(1, L + 1):
        call_hook = layer_call(f2)
        call = layer_call(False)
        pre_forward(k, call_hook)
        body = [pyframe("forward", MODEL_PY, 390)] + inner(call)
        attn = [pyframe("forward", MODEL_PY, 250), F.call_impl_fast, F.wrapped, pyframe("forward", MODEL_PY, 388)] + inner(call)
        ffn = [pyframe("forward", MODEL_PY, 330), F.call_impl_fast, F.wrapped, pyframe("forward", MODEL_PY, 389)] + inner(call)
        lin = [pyframe("forward", "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125), F.call_impl_fast,
               F.wrapped]
        temp(k, bsd * 2, [pyframe("forward", MODEL_PY, 60), F.call_impl_fast, F.wrapped] + body)   # fp32 norm upcast
        act(k, bsd, [pyframe("forward", MODEL_PY, 62), F.call_impl_fast, F.wrapped] + body)        # attention_norm
        act(k, bsd, lin + attn)                                                                   # xq
        act(k, bsd * m.kv_dim // m.dim, lin + attn)                                               # xk
        act(k, bsd * m.kv_dim // m.dim, lin + attn)                                               # xv
        act(k, bsd, [pyframe("apply_rotary_emb", MODEL_PY, 120)] + attn)                           # rope q
        act(k, bsd, [pyframe("forward", MODEL_PY, 262)] + attn)                                    # sdpa out
        act(k, m.batch * m.n_heads * m.seq * 4, [pyframe("forward", MODEL_PY, 262)] + attn)        # logsumexp
        act(k, bsd, lin + attn)                                                                   # wo
        act(k, bsd, body)                                                                         # h = x + attn
        act(k, bsd, [pyframe("forward", MODEL_PY, 62), F.call_impl_fast, F.wrapped] + body)        # ffn_norm
        if oom_layer == k:
            return die(bsh * 4, ALLOC_PREFIX + MM_OP + lin + ffn, unit_label(k))
        act(k, bsh, lin + ffn)                                                                    # w1
        act(k, bsh, lin + ffn)                                                                    # w3
        act(k, bsh, [pyframe("forward", MODEL_PY, 331)] + ffn)                                     # silu * w3
        act(k, bsd, lin + ffn)                                                                    # w2
        act(k, bsd, body)                                                                         # out
        if k < L:   # torchtitan: the last block is not resharded after forward
            reshard(k, ([F.post_forward_group, F.post_forward_state] + fsdp_hook + call_hook) if f2 else
                    ([F.f1_post_forward_reshard, F.f1_post_forward, F.f1_forward_post] + call_hook))
    logits = bsd * m.vocab // m.dim
    linear_py = pyframe("forward", "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125)
    if m.tail_unit:
        # fully_shard([norm, output]): the group's pre-forward hook (FSDP2's wrapped_pre_hook) runs in the norm's
        # call and gathers both; the output's call is the norm's sibling in the root's forward
        T = L + 1
        norm_call = [F.call_impl_hook, F.wrapped, pyframe("forward", MODEL_PY, 485)] + root_body[1:]
        pre_forward(T, fsdp_hook + [F.group_pre_hook] + norm_call)
        act(T, bsd, [pyframe("forward", MODEL_PY, 62), F.call_impl_fwd, F.wrapped, pyframe("forward", MODEL_PY, 485)]
            + root_body[1:])
        act(T, logits, [linear_py, F.call_impl_fwd, F.wrapped, pyframe("forward", MODEL_PY, 486)] + root_body[1:])
    else:
        # the root: final norm and output projection, then the loss (outside the model: no unit)
        act(0, bsd, [pyframe("forward", MODEL_PY, 62), F.call_impl_fast, F.wrapped] + root_body)
        act(0, logits, [linear_py, F.call_impl_fast, F.wrapped] + root_body)
    if f2 and state["deferred"] is not None:      # the root's post-forward frees the last all-gather output
        rec.free(state["ag_flat"].pop(state["deferred"]), FREE_PREFIX + [F.post_forward_state] + fsdp_hook + root_hook)
        state["deferred"] = None
    loss_at = [pyframe("cross_entropy_loss", LOSS_PY, 20)] + _main_chain(F, 460)
    if oom_layer == OOM_IN_LOSS:     # the loss's fp32 upcast of the logits does not fit
        return die(logits * 2, ALLOC_PREFIX + MM_OP + [pyframe(
            "cross_entropy", "/usr/lib/python3.11/site-packages/torch/nn/functional.py", 3462)] + loss_at, None)
    act(None, logits * 2, [pyframe("cross_entropy", "/usr/lib/python3.11/site-packages/torch/nn/functional.py",
                                   3462)] + loss_at)
    # ---------------- backward (the autograd engine's thread: C++ frames, and FSDP's hooks)
    def hook_chain(fn_frame):
        return [fn_frame, F.autograd_apply] + ENGINE

    rec.free(state["acts"][None].pop(), FREE_PREFIX + ENGINE)                       # the loss's saved tensor
    temp(None, logits * 2, ENGINE)
    grads_root = [rec.alloc(math.prod(s) * gb, ALLOC_PREFIX + MM_OP[:3] + ENGINE, "unsharded_grad", unit_label(0))
                  for s in m.root_params()]
    if m.tail_unit:     # the tail unit's backward first: kept unsharded since its forward, reduced first
        T = L + 1
        grads_t = [rec.alloc(math.prod(s) * gb, ALLOC_PREFIX + MM_OP[:3] + ENGINE, "unsharded_grad", unit_label(T))
                   for s in m.tail_params()]
        for a in state["acts"].pop(T):
            rec.free(a, FREE_PREFIX + ENGINE)
        reshard(T, [F.post_backward_reshard, F.post_bwd_fn, F.autograd_apply] + ENGINE)
        _reduce(m, F, rec, state, T, grads_t, [F.post_backward_reduce, F.post_bwd_fn, F.autograd_apply] + ENGINE)
    root_acts = state["acts"].pop(0)
    for a in root_acts[1:]:
        rec.free(a, FREE_PREFIX + ENGINE)
    f1_hook = [cframe("torch::autograd::PyFunctionTensorPreHook::operator()(std::vector<at::Tensor, std::allocator<"
                      "at::Tensor> > const&)", "python_hook.cpp")] + ENGINE
    for k in range(L, 0, -1):
        pre_bwd = ([F.pre_backward_state] + fsdp_hook + hook_chain(F.pre_bwd_fn)) if f2 else f1_hook
        if k not in state["unsharded"]:
            copy_out(k, [F.pre_backward_group_wait] + pre_bwd, True) if f2 else None
        if k - 1 >= 1:        # prefetch the next unit in backward order
            chain = ([F.prefetch_unshard, F.backward_prefetch, F.pre_backward_group_prefetch] if f2 else
                     [F.f1_prefetch, F.f1_pre_backward]) + pre_bwd
            gather(k - 1, chain, True)
        grads = []
        for s in m.layer_params():
            temp(k, bsh if len(s) > 1 else bsd, ENGINE)                              # activation grads
            grads.append(rec.alloc(math.prod(s) * gb, ALLOC_PREFIX + MM_OP[:3] + ENGINE, "unsharded_grad", unit_label(k)))
        for a in state["acts"].pop(k):
            rec.free(a, FREE_PREFIX + ENGINE)
        # post-backward: reshard, reduce-scatter (fp32), free the unsharded grads
        post = ([F.post_backward_reduce, F.post_bwd_fn, F.autograd_apply] if f2 else
                [F.f1_reduce_grad, F.f1_post_backward]) + ENGINE
        reshard(k, [F.post_backward_reshard, F.post_bwd_fn, F.autograd_apply] + ENGINE if f2 else post)
        _reduce(m, F, rec, state, k, grads, post)
    # the root last: its copy-out was kept (not resharded after forward), its reduce ends the backward
    if m.tail_unit:     # (torchtitan's embedding unit was resharded after forward: gathered again)
        pre_bwd = [F.pre_backward_state] + fsdp_hook + hook_chain(F.pre_bwd_fn)
        gather(0, [F.pre_backward_group_wait] + pre_bwd, True)
        copy_out(0, [F.pre_backward_group_wait] + pre_bwd, True)
    rec.free(root_acts[0], FREE_PREFIX + ENGINE)
    _reduce(m, F, rec, state, 0, grads_root, ([F.post_backward_reduce, F.post_bwd_fn, F.autograd_apply] if f2 else
                                              [F.f1_reduce_grad, F.f1_post_backward]) + ENGINE)
    reshard(0, ([F.post_backward_reshard, F.post_bwd_fn, F.autograd_apply] if f2 else
                [F.f1_reduce_grad, F.f1_post_backward]) + ENGINE)
    for a in state["rs_in"]:
        rec.free(a, FREE_PREFIX)
    state["rs_in"] = []
    # ---------------- optimizer: AdamW (foreach) temporaries, then zero_grad frees the sharded grads
    opt = [F.adamw, F.opt_step, F.no_grad, F.opt_wrapper] + _main_chain(F, 480)
    total_shard = sum(m.shard_numel(s) for k in range(n_units) for s in m.unit_params(k)) * 4
    temp(None, total_shard, opt)
    for a in state["sharded_grads"]:
        rec.free(a, FREE_PREFIX + [F.zero_grad] + _main_chain(F, 485))
    return False


def _reduce(m: Model, F: Frames, rec: Recorder, state: dict, k: int, grads: list, post: list) -> None:
    """foreach_reduce (FSDP2) / _reduce_grad (FSDP1): the reduce-scatter input (fp32, padded unsharded),
    the autograd grads freed, the output (the new sharded grad, fp32) kept until zero_grad; an earlier
    reduce-scatter input is freed (FSDP2 keeps one in flight)."""
    u = unit_label(k)
    W = m.world
    if m.family == "fsdp2":
        n_in = sum(m.shard_numel(s) for s in m.unit_params(k)) * W * 4
        a_in = rec.alloc(n_in, ALLOC_PREFIX + EMPTY_OP + [F.allocate, F.reduce_in, F.no_grad] + post, "unsharded_grad", u)
        for g in grads:
            rec.free(g, FREE_PREFIX + [F.reduce_clear, F.no_grad] + post)
        out = rec.alloc(n_in // W, ALLOC_PREFIX + EMPTY_OP + [F.allocate, F.reduce_out, F.no_grad] + post,
                        "sharded_grad", u, stream=2)
        for old in state["rs_in"]:
            rec.free(old, FREE_PREFIX + post)
        state["rs_in"] = [a_in]
    else:
        n_in = m.flat_shard_numel(k) * W * 4
        a_in = rec.alloc(n_in, ALLOC_PREFIX + [F.f1_rs_tensors] + post, "unsharded_grad", u)
        out = rec.alloc(n_in // W, ALLOC_PREFIX + EMPTY_OP + [F.f1_rs_tensors] + post, "sharded_grad", u, stream=2)
        for g in grads:
            rec.free(g, FREE_PREFIX + post)
        rec.free(a_in, FREE_PREFIX + post)
    state["sharded_grads"].append(out)
