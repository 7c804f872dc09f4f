"""fsdpprof bootstrap, loaded by every Python process of a job run under ``fsdpprof record`` (first on PYTHONPATH).

Cheap and harmless in processes that never train: it imports neither torch nor fsdpprof, only adds a meta-path
hook that registers fsdpprof's optimizer-step hooks once ``torch.optim.optimizer`` is loaded. The next
``sitecustomize`` on sys.path (the user's or the system's) still runs. No exception ever escapes from this file.
"""
import os
import sys

_TARGET = "torch.optim.optimizer"


def _fsdpprof_chain_sitecustomize():
    """Run the next ``sitecustomize`` on sys.path (skipping this folder), as ``site`` would."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import importlib.machinery
        import importlib.util

        paths = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception as err:  # same message as site.execsitecustomize
        try:
            if sys.flags.verbose:
                sys.excepthook(*sys.exc_info())
            else:
                sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                                 "%s: %s\n" % (err.__class__.__name__, err))
        except Exception:  # a closed or full stderr
            pass


class _FsdpprofOptimHook:
    """Meta-path finder: once torch.optim.optimizer has run, install fsdpprof's step hooks."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None:
                original_exec = spec.loader.exec_module

                def exec_module(module):
                    original_exec(module)
                    _fsdpprof_install(module)

                spec.loader.exec_module = exec_module   # (this spec's own loader object)
            return spec
        except Exception:
            return None


def _fsdpprof_install(optimizer_module):
    try:
        try:
            import fsdpprof.collect.recorder as recorder
        except ImportError:
            parent = os.environ.get("FSDPPROF_PKG_PARENT")
            if not parent:
                return
            sys.path.append(parent)
            import fsdpprof.collect.recorder as recorder
        recorder.install_from_env(optimizer_module)
    except Exception:
        pass


def _fsdpprof_bootstrap():
    try:
        if os.environ.get("FSDPPROF_RUN_DIR") and os.environ.get("FSDPPROF_DISABLE") != "1":
            if _TARGET in sys.modules:  # unusual: torch imported before site
                _fsdpprof_install(sys.modules[_TARGET])
            else:
                sys.meta_path.insert(0, _FsdpprofOptimHook())
    except Exception:
        pass


_fsdpprof_bootstrap()
_fsdpprof_chain_sitecustomize()
