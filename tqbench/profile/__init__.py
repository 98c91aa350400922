"""Hot-expert profiles: learned from every session, fed to the expert cache, shared as files."""

from tqbench.profile.choose import Choice, choose, identify, read_file, read_profile
from tqbench.profile.compare import DiffSide, LayerDiff, OverallDiff, ProfileDiff, diff, hot_set, merge
from tqbench.profile.fingerprint import Geometry, fingerprint, geometry
from tqbench.profile.learn import Learner, tap
from tqbench.profile.overview import (ChatStart, Overview, ProfileStamp, overview, overview_file, overview_profile,
                                      profile_stamp, profile_view)
from tqbench.profile.profile import (DECAY, MATURE, PIN_SHARE, PREFILL_WEIGHT, SCHEMA, SHIPPED_PIN_SHARE, Profile,
                                     ProfileError)
from tqbench.profile.share import Forgotten, default_export_file, export_learned, forget_learned, import_file
from tqbench.profile.store import ProfileStore
from tqbench.profile.summary import Coverage, HotExpert, LayerSummary, ProfileSummary, summary

__all__ = ["ChatStart", "Choice", "Coverage", "DECAY", "DiffSide", "Forgotten", "Geometry", "HotExpert", "LayerDiff",
           "LayerSummary", "Learner", "MATURE", "OverallDiff", "Overview", "PIN_SHARE", "PREFILL_WEIGHT", "Profile",
           "ProfileDiff", "ProfileError", "ProfileStamp", "ProfileStore", "ProfileSummary", "SCHEMA",
           "SHIPPED_PIN_SHARE", "choose", "default_export_file", "diff", "export_learned", "fingerprint",
           "forget_learned", "geometry", "hot_set", "identify", "import_file", "merge", "overview", "overview_file",
           "overview_profile", "profile_stamp", "profile_view", "read_file", "read_profile", "summary", "tap"]
