"""pagefleet.operator: the kopf operator that runs InferenceService objects as worker Deployments.

Importing the package registers the handlers, so `kopf run -m pagefleet.operator` works as well as
`pagefleet operator`. Nothing here imports pagefleet.worker or pagefleet.kernels: the operator's image has no torch.
"""

from pagefleet.operator import handlers  # noqa: F401
