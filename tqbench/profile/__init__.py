"""Hot-expert profiles: learned from every session, fed to the expert cache, shared as files."""

from tqbench.profile.choose import Choice, choose, identify, read_file, read_profile
from tqbench.profile.compare import diff, hot_set, merge, overview, overview_file, overview_profile, summary
from tqbench.profile.fingerprint import Geometry, fingerprint, geometry
from tqbench.profile.learn import Learner, tap
from tqbench.profile.profile import (DECAY, MATURE, PIN_SHARE, PREFILL_WEIGHT, SCHEMA, SHIPPED_PIN_SHARE, Profile,
                                     ProfileError)
from tqbench.profile.share import export_learned, import_file
from tqbench.profile.store import ProfileStore

__all__ = ["Choice", "DECAY", "Geometry", "Learner", "MATURE", "PIN_SHARE", "PREFILL_WEIGHT", "Profile", "ProfileError",
           "ProfileStore", "SCHEMA", "SHIPPED_PIN_SHARE",
           "choose", "diff", "export_learned", "fingerprint", "geometry", "hot_set", "identify", "import_file", "merge",
           "overview", "overview_file", "overview_profile", "read_file", "read_profile", "summary", "tap"]
