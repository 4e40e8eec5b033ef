"""subq's control plane: settings, models, todo lists, the Redis store and the Coordinator.

    from coordinator import Coordinator, Settings, SubtaskSpec

Services that trigger work need only this package (or only Celery, sending
`subq.*` tasks by name); it never imports `workers`.
"""

from coordinator.errors import (
    ConfigError,
    ConflictError,
    CorruptError,
    NotFoundError,
    ProfileError,
    ScriptError,
    StateError,
    StoreError,
    SubqError,
    TodoError,
    ValidationError,
    WaitTimeout,
)
from coordinator.models import Batch, SubtaskResult, SubtaskSpec, TaskRecord, TaskStatus, TodoItem, TodoStatus, Usage
from coordinator.service import Coordinator
from coordinator.settings import Profile, Settings, load_settings

__all__ = [
    "Batch",
    "ConfigError",
    "ConflictError",
    "Coordinator",
    "CorruptError",
    "NotFoundError",
    "Profile",
    "ProfileError",
    "ScriptError",
    "Settings",
    "StateError",
    "StoreError",
    "SubqError",
    "SubtaskResult",
    "SubtaskSpec",
    "TaskRecord",
    "TaskStatus",
    "TodoError",
    "TodoItem",
    "TodoStatus",
    "Usage",
    "ValidationError",
    "WaitTimeout",
    "load_settings",
]
