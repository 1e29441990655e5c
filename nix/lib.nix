# Pure helpers of the NixOS module, kept free of nixpkgs so that CI can evaluate them on their own.
{
  # The janitor's command line for the given settings.
  janitorArgs =
    { longHeld, keepRunsDays, metricsFile }:
    [ "janitor" "--long-held" (toString longHeld) ]
    ++ (if keepRunsDays == null then [ ] else [ "--keep-runs" (toString keepRunsDays) ])
    ++ (if metricsFile == null then [ ] else [ "--metrics-file" metricsFile ]);

  # /etc/ccci-run/config.toml: the one place the host's paths are set. Every ccci-run on the
  # host reads it (the Drone step, the janitor's timer, an operator's shell), so they cannot drift.
  configToml =
    { lockDir, runsDir, abraHome, docker }:
    ''
      # Written by the NixOS module services.ccci-run; `ccci-run config` shows what is in force.
      lock_dir = "${lockDir}"
      runs_dir = "${runsDir}"
      abra_home = "${abraHome}"
      docker = "${docker}"
    '';
}
