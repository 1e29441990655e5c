# Pure helpers of the NixOS module, kept free of nixpkgs so that CI can evaluate them on their own.
{
  # The janitor's command line for the given settings.
  janitorArgs =
    { longHeld, keepRunsDays, metricsFile }:
    [ "janitor" "--long-held" (toString longHeld) ]
    ++ (if keepRunsDays == null then [ ] else [ "--keep-runs" (toString keepRunsDays) ])
    ++ (if metricsFile == null then [ ] else [ "--metrics-file" metricsFile ]);

  # The environment every ccci-run on the host shares.
  environment =
    { lockDir, runsDir, abraHome, docker }:
    {
      CCCI_APP_LOCK_DIR = lockDir;
      CCCI_RUNS_DIR = runsDir;
      CCCI_ABRA_HOME = abraHome;
      CCCI_DOCKER = docker;
    };
}
