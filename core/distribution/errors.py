"""Errors of talking to a model registry; the HTTP layer answers them 502 (the upstream failed, not the client)."""

from corral.errors import CorralError


class RegistryError(CorralError):
    """The registry could not be reached, refused a request, or sent something unusable."""


class RegistryAuthError(RegistryError):
    """The registry (or its token service) refused the credentials corral has for it."""


class UntrustedContentError(RegistryError):
    """A manifest or blob from the registry is malformed, oversize, or does not match its digest."""


class RegistryUnreachableError(RegistryError):
    """No connection to the registry could be made (a name, network or TLS failure)."""


class NotEnoughSpaceError(CorralError):
    """The store's disk has less free space than the blobs to pull need."""
