"""fsdpprof bootstrap, loaded by every Python process of a job run under ``fsdpprof record``.

``fsdpprof record`` puts this folder first on PYTHONPATH. It must stay cheap and harmless in
processes that never train (torchrun's agent, tools): it imports neither torch nor fsdpprof here,
only adds a meta-path hook that fires when ``torch.optim.optimizer`` is imported and then
registers fsdpprof's global optimizer-step hooks. A user's or the system's own
``sitecustomize`` (the next one on sys.path) still runs, as it would without us.
No exception ever escapes from this file.
"""
import os
import sys


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
    """Meta-path finder: when torch.optim.optimizer is loaded, install fsdpprof's step hooks."""

    target = "torch.optim.optimizer"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            original_exec = loader.exec_module

            def exec_module(module, _orig=original_exec):
                _orig(module)
                _fsdpprof_install(module)

            wrapped = _FsdpprofLoader(loader, exec_module)
            spec.loader = wrapped
            return spec
        except Exception:
            return None


class _FsdpprofLoader:
    """Delegates everything to the real loader; runs fsdpprof's install after exec_module."""

    def __init__(self, loader, exec_module):
        self._loader = loader
        self.exec_module = exec_module

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def __getattr__(self, name):
        return getattr(self._loader, name)


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
            if "torch.optim.optimizer" in sys.modules:  # unusual: torch imported before site
                _fsdpprof_install(sys.modules["torch.optim.optimizer"])
            else:
                sys.meta_path.insert(0, _FsdpprofOptimHook())
    except Exception:
        pass


_fsdpprof_bootstrap()
_fsdpprof_chain_sitecustomize()
