"""omniloom.kernels: Triton kernels, their PyTorch references and custom-op wrappers.

Always imported as `omniloom.kernels`; a bare `import kernels` is not this package.
"""
