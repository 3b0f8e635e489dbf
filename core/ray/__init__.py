"""corral on Ray Serve: replicas that each own a corral server, behind an OpenAI-compatible ingress.

    serve run corral.ray:app model=smollm2 num_replicas=2

`app` is a Ray Serve application builder; its arguments (strings on the command line) are `ReplicaSettings`:
`model`, `num_replicas` or autoscaling (`min_replicas`, `max_replicas`, `target_ongoing_requests`),
`max_ongoing_requests`, `num_cpus` per replica, `store` (a store directory; default corral's) and `runner`.
Requests are routed to the replica likely to hold their prompt's prefix in its KV cache (routing.py).
Needs the `ray` extra: `pip install -e ".[ray]"`.
"""

from __future__ import annotations

import attrs

# ray[serve] (~470 MB) is the optional `ray` extra, not a base dependency: the README's first command
# stays light. Without it, importing corral.ray says what to install.
try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
except ImportError as error:
    raise ImportError(f'corral.ray needs Ray Serve: pip install "corral[ray]" ({error})') from error

from corral.errors import CorralError
from corral.ray.ingress import CorralIngress
from corral.ray.replica import CorralReplica

__all__ = ["ReplicaSettings", "app", "build"]


class SettingsError(CorralError):
    """An argument of `corral.ray:app` is unknown or of the wrong kind."""


# How often a stopping replica checks that its requests are done (Ray Serve's default, 2 s, is also the least a stop
# takes): each deployment of the application stops in turn, so `serve run`'s Ctrl-C waits this once per deployment.
DRAIN_POLL_S = 0.5
# How often Ray Serve's controller calls a replica's check_health (its default: 10 s). A replica that died is noticed at
# its next check, so this bounds how long the application runs a replica short; a check is one loopback GET /health.
HEALTH_CHECK_PERIOD_S = 2.0


def _optional_int(value) -> int | None:
    return None if value in (None, "") else int(value)


@attrs.frozen(kw_only=True)
class ReplicaSettings:
    """How many replicas of which model, and what each may take."""

    model: str = "smollm2"
    num_replicas: int | None = attrs.field(default=None, converter=_optional_int)
    min_replicas: int | None = attrs.field(default=None, converter=_optional_int)
    max_replicas: int | None = attrs.field(default=None, converter=_optional_int)
    target_ongoing_requests: float = attrs.field(default=2.0, converter=float)
    max_ongoing_requests: int = attrs.field(default=8, converter=int)  # corral batches these together in one replica
    num_cpus: float = attrs.field(default=1.0, converter=float)
    store: str | None = None
    runner: str | None = None

    @classmethod
    def from_args(cls, args: dict) -> ReplicaSettings:
        """Settings from `serve run`'s key=value arguments, with a clear error for a bad one."""
        known = {field.name for field in attrs.fields(cls)}
        if unknown := sorted(set(args) - known):
            raise SettingsError(f"unknown argument(s) {', '.join(unknown)} for corral.ray:app; known: {', '.join(sorted(known))}")
        try:
            settings = cls(**args)
        except (TypeError, ValueError) as error:
            raise SettingsError(f"bad argument for corral.ray:app: {error}") from None
        if settings.num_replicas is not None and (settings.min_replicas is not None or settings.max_replicas is not None):
            raise SettingsError("give num_replicas, or min_replicas/max_replicas for autoscaling, not both")
        return settings

    def deployment_options(self) -> dict:
        """Ray Serve deployment options of the replicas: their count or autoscaling, and the prefix router."""
        options = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus},
            "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
            "health_check_period_s": HEALTH_CHECK_PERIOD_S,
            "request_router_config": RequestRouterConfig(request_router_class="corral.ray.routing:PrefixAffinityRouter"),
        }
        if self.min_replicas is not None or self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            options["autoscaling_config"] = {
                "min_replicas": low,
                "max_replicas": self.max_replicas if self.max_replicas is not None else max(low, 1),
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            options["num_replicas"] = self.num_replicas if self.num_replicas is not None else 1
        return options


def build(settings: ReplicaSettings) -> serve.Application:
    """The application: the ingress (no CPU of its own: it only forwards) bound to the replicas."""
    replicas = serve.deployment(CorralReplica).options(**settings.deployment_options())
    ingress = serve.deployment(CorralIngress).options(ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
    return ingress.bind(replicas.bind(settings.model, settings.store, settings.runner))


def app(args: dict) -> serve.Application:
    """Ray Serve's application builder (`serve run corral.ray:app model=smollm2 num_replicas=2`)."""
    return build(ReplicaSettings.from_args(args))
