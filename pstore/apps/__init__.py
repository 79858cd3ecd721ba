"""Applications built on the pstore library: what ``pstore demo`` runs.

- :mod:`pstore.apps.demo`: the ``pstore demo`` command (matrix factorisation on MovieLens-100k,
  or DeepFM on Criteo-shaped clicks);
- :mod:`pstore.apps.datasets`: the demo's data (MovieLens-100k, found or fetched; synthetic
  ratings; Criteo-shaped clicks);
- :mod:`pstore.apps.ctr`: DeepFM click-through-rate models on the store (needs torch);
- :mod:`pstore.apps.mf_onnx`: the demo's whole matrix-factorisation model as one ONNX graph
  (needs onnx).

The library (``pstore`` outside this package) never imports these modules: the ``pstore``
command finds ``pstore demo`` through the ``pstore.commands`` entry-point group, where this
package registers it.
"""
