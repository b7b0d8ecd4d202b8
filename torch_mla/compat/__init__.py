"""Drop-in interfaces of other MLA libraries on top of torch_mla's ops."""

from . import flash_mla

__all__ = ["flash_mla"]
