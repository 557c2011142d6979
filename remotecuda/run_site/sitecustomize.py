"""Activation of every Python process a ``remotecuda run`` program starts (remotecuda/children.py).

``remotecuda run`` puts this file's directory first on ``PYTHONPATH`` and sets ``REMOTECUDA_RUN``,
so each Python process started under it (a script run by ``subprocess``, ``torchrun``'s and
``accelerate launch``'s workers, spawned ``multiprocessing`` children) imports this module at its
start, as ``site`` imports any ``sitecustomize``. It activates remotecuda when the process first
imports torch, not now: a child that never uses torch (``python -c pass``, pip, a tool written in
Python) imports nothing of remotecuda's or torch's. The ``sitecustomize`` the environment had
(the next one on ``sys.path``) is then run as Python would have run it.

Only the standard library is imported here: this runs in every such process, before its program.
"""
import importlib.machinery
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _ActivateAfterTorch:
    """A ``sys.meta_path`` finder that finds nothing itself: it hands torch's spec back with a loader
    that activates remotecuda once torch's ``__init__`` has run, and leaves ``sys.meta_path``.
    (No importlib.abc base classes: importing them costs every process a few milliseconds.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        from importlib.util import find_spec  # (here: it costs a process that never imports torch ~3 ms)
        sys.meta_path.remove(self)
        spec = find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Activating(spec.loader)
        return spec


class _Activating:
    """torch's own loader, and then remotecuda's activation (children.activate_run_child)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        # torch is whole now: its own loader is given back (importlib.resources, linecache ask it),
        # and it is marked loaded, so that a thread the activation starts that imports torch does
        # not wait for this import to end (which waits for the activation)
        module.__loader__ = module.__spec__.loader = self.loader
        module.__spec__._initializing = False
        children = _children()
        if children is None:
            sys.stderr.write(f"remotecuda run: {sys.executable} cannot import remotecuda: 'cuda' in this "
                             "process is its torch's own\n")
            return
        children.activate_run_child()


def _children():
    """remotecuda.children, from the remotecuda this file belongs to where the process finds none
    (a checkout run as ``python -m remotecuda`` from its directory, the child's elsewhere); None
    where remotecuda cannot be imported at all (another Python, lacking its dependencies)."""
    try:
        from remotecuda import children
    except ImportError:
        sys.path.append(os.path.dirname(os.path.dirname(_HERE)))
        try:
            from remotecuda import children
        except ImportError:
            return None
    return children


def _chain():
    """Run the ``sitecustomize`` this one stands in front of, if any, as the one Python imports."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    from importlib.util import module_from_spec
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get("REMOTECUDA_RUN") and "torch" not in sys.modules:
    sys.meta_path.insert(0, _ActivateAfterTorch())
_chain()
