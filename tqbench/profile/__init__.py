"""Hot-expert profiles: learned from every session, fed to the expert cache, shared as files."""

from tqbench.profile.choose import Choice, choose, read_file
from tqbench.profile.fingerprint import Geometry, fingerprint, geometry
from tqbench.profile.learn import Learner, tap
from tqbench.profile.profile import MATURE, SCHEMA, Profile, ProfileError
from tqbench.profile.store import ProfileStore

__all__ = ["Choice", "Geometry", "Learner", "MATURE", "Profile", "ProfileError", "ProfileStore", "SCHEMA", "choose",
           "fingerprint", "geometry", "read_file", "tap"]
