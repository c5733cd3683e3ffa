"""`fleetjax.fleet.role_maker`: the role makers, also at Paddle's path
`fleetjax.fleet.base.role_maker` (where they are defined)."""

from fleetjax.fleet.base.role_maker import (
    JaxProcessRoleMaker,
    PaddleCloudRoleMaker,
    Role,
    RoleMakerBase,
    UserDefinedRoleMaker,
)

__all__ = [
    "JaxProcessRoleMaker",
    "PaddleCloudRoleMaker",
    "Role",
    "RoleMakerBase",
    "UserDefinedRoleMaker",
]
