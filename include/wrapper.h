/*
 * Input of bindgen for the gpuhub SPANK plugin (spank/build.rs).
 *
 * Only the installed Slurm headers are used (Debian: libslurm-dev, RHEL: slurm-devel);
 * they are never downloaded. slurm_version.h gives SLURM_VERSION_NUMBER, which the plugin
 * exports as `plugin_version`: Slurm loads a SPANK plugin only when its major.minor matches,
 * so the plugin is rebuilt for every Slurm release it runs on.
 */
#include <slurm/spank.h>
#include <slurm/slurm_version.h>
