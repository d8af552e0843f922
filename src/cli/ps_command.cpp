#include <cohort/cluster.h>
#include <cohort/error.h>

#include "base/files.h"
#include "cli/commands.h"
#include "ps/service.h"

#include <cstdlib>
#include <memory>

namespace cohort::cli {

std::string resolveAuthToken(const std::string& token, const std::string& file) {
  COHORT_CHECK(token.empty() || file.empty(), InvalidArgument, "give --auth-token or --auth-token-file, not both");
  if (!token.empty()) return token;
  if (!file.empty()) {
    std::string secret = readNamedFile("--auth-token-file", file);
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r' || secret.back() == ' ')) secret.pop_back();
    COHORT_CHECK(!secret.empty(), InvalidArgument, "--auth-token-file ", file, " is empty");
    return secret;
  }
  if (const char* env = std::getenv("COHORT_AUTH_TOKEN"); env != nullptr) return env;
  return "";
}

Run addPsCommand(CLI::App& app) {
  struct Flags {
    std::string host = "0.0.0.0";
    int port = 0;
    std::string checkpointDir;
    std::string authToken;
    std::string authTokenFile;
    std::string tlsCert;
    std::string tlsKey;
  };
  auto flags = std::make_shared<Flags>();
  CLI::App* command = app.add_subcommand("ps", "Serve one parameter-server shard");
  command->footer(
      "The shard learns its model, update policy and optimizer from the chief worker's Init, and ends\n"
      "when every worker is done. With --checkpoint-dir it checkpoints there and, when restarted, resumes\n"
      "from its newest checkpoint; a final checkpoint (when every worker is done) that cannot be written\n"
      "ends it with status 1 and the reason. Workers find it through TF_CONFIG's \"ps\" list or --ps-hosts.");
  command->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  command->add_option("--host", flags->host, "Address to listen on")->capture_default_str();
  command->add_option("--port", flags->port, "Port to listen on (0: a free one, printed)")->capture_default_str();
  command->add_option("--checkpoint-dir", flags->checkpointDir, "Checkpoint the shard here; resume from it on start");
  command->add_option("--auth-token", flags->authToken,
                      "Shared secret every request must carry (default: $COHORT_AUTH_TOKEN)");
  command->add_option("--auth-token-file", flags->authTokenFile, "Read the shared secret from this file");
  command->add_option("--tls-cert", flags->tlsCert, "PEM certificate: serve TLS (with --tls-key)");
  command->add_option("--tls-key", flags->tlsKey, "PEM private key of --tls-cert");
  return [flags]() {
    const Flags& f = *flags;
    COHORT_CHECK(f.port >= 0 && f.port <= 65535, InvalidArgument, "--port must be between 0 and 65535, got ", f.port);
    ps::ServerOptions options;
    options.address = HostPort{f.host, f.port}.str();
    options.authToken = resolveAuthToken(f.authToken, f.authTokenFile);
    options.tlsCertFile = f.tlsCert;
    options.tlsKeyFile = f.tlsKey;
    options.shard.checkpointDir = f.checkpointDir;
    return runShardProcess(options);
  };
}

}  // namespace cohort::cli
