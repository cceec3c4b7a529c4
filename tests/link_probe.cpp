// Two workers' links across the testbed's namespaces (tests/test_link.cpp,
// docs/several-machines.md's figures): each end publishes its addresses as a
// file in a folder both see, opens the link to the other, and trades a
// message of `mb` MB each way, both directions at once, `rounds` times, idle
// for `pause` seconds between rounds (as a link is between outer steps),
// its sends paced to `uplink` when given (comm/link/uplink_share.h).
//
//   link_probe relay BIND PORT                       # a relay, until killed
//   link_probe end DIR NAME PEER RANK BIND RELAY MB ROUNDS [PAUSE [UPLINK]]
//
// An end prints one JSON line: the route, the relay, and each round's seconds.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/link/link_endpoint.h"
#include "comm/store/run_keys.h"
#include "util/parse_number.h"

using namespace noloco;

namespace {

const std::string kToken = "link-probe";

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int relay(const std::string& bind, int port) {
  RelayServer server(bind, port, run_key(kToken, "relay"));
  std::cout << "relay " << server.port() << std::endl;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  int signal = 0;
  sigwait(&set, &signal);
  const auto s = server.stats();
  std::cout << "{\"spliced\":" << s.spliced << ",\"bytes\":" << s.bytes << ",\"reflected\":" << s.reflected << "}"
            << std::endl;
  return 0;
}

int end(char** argv) {
  const std::filesystem::path dir = argv[2];
  const std::string name = argv[3], peer_name = argv[4];
  const int rank = std::stoi(argv[5]);
  LinkEndpointOptions options;
  options.bind = argv[6];
  if (std::string(argv[7]) != "none") options.relays = {argv[7]};
  const size_t bytes = size_t(std::stod(argv[8]) * 1e6);
  const int rounds = std::stoi(argv[9]);
  const double pause = argv[10] ? std::stod(argv[10]) : 0;
  if (argv[10] && argv[11]) options.uplink = parse_bit_rate("uplink", argv[11]);
  LinkEndpoint endpoint(options, run_key(kToken, "link"), run_key(kToken, "relay"));
  const LinkEnd self{"probe", rank, 0}, peer{"probe", 1 - rank, 0};
  endpoint.serve(self);
  const auto a = endpoint.addresses();
  {
    std::ofstream(dir / (name + ".tmp")) << a.listen << "|" << a.reflexive << "\n";
    std::filesystem::rename(dir / (name + ".tmp"), dir / (name + ".addr"));
  }
  const auto theirs_path = dir / (peer_name + ".addr");
  for (int i = 0; i < 300 && !std::filesystem::exists(theirs_path); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto text = read_file(theirs_path);
  LinkAddresses theirs;
  theirs.listen = text.substr(0, text.find('|'));
  theirs.reflexive = text.substr(text.find('|') + 1);
  theirs.reflexive.erase(theirs.reflexive.find_last_not_of("\n") + 1);
  std::string problem;
  const auto link =
      endpoint.open(self, peer, theirs, "0", Clock::now() + std::chrono::seconds(30), nullptr, &problem);
  if (!link) {
    std::cout << "{\"error\":\"" << problem << "\"}" << std::endl;
    return 1;
  }
  std::vector<uint8_t> out(bytes, uint8_t(rank + 1)), in(bytes);
  std::vector<double> seconds;
  for (int r = 0; r < rounds; ++r) {
    if (r > 0) {
      // Both ends start a round together, as an exchange's members do once they met.
      std::this_thread::sleep_for(std::chrono::duration<double>(pause));
      uint8_t mark = 1, theirs = 0;
      const auto by = Clock::now() + std::chrono::seconds(30);
      if (!link->send({{&mark, 1}}, by) || link->receive(&theirs, 1, by) != 1) {
        std::cout << "{\"error\":\"before round " << r << ": " << link->problem() << "\"}" << std::endl;
        return 1;
      }
    }
    const auto start = Clock::now(), deadline = start + std::chrono::seconds(120);
    bool sent = false;
    std::thread sender([&] { sent = link->send({{out.data(), out.size()}}, deadline); });
    const auto got = link->receive(in.data(), in.size(), deadline);
    sender.join();
    if (!sent || got != int64_t(bytes) || in[bytes / 2] != uint8_t(2 - rank)) {
      std::cout << "{\"error\":\"round " << r << ": " << link->problem() << "\"}" << std::endl;
      return 1;
    }
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::cout << "{\"route\":\"" << route_name(link->route()) << "\",\"relay\":\"" << link->relay()
            << "\",\"reflexive\":\"" << a.reflexive << "\",\"bytes_sent\":" << link->bytes_sent() << ",\"seconds\":[";
  for (size_t i = 0; i < seconds.size(); ++i) std::cout << (i ? "," : "") << seconds[i];
  std::cout << "]}" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 4 && std::string(argv[1]) == "relay") return relay(argv[2], std::stoi(argv[3]));
    if (argc >= 10 && argc <= 12 && std::string(argv[1]) == "end") return end(argv);
  } catch (const std::exception& e) {
    std::cout << "{\"error\":\"" << e.what() << "\"}" << std::endl;
    return 1;
  }
  std::cerr << "usage: link_probe relay BIND PORT | end DIR NAME PEER RANK BIND RELAY MB ROUNDS [PAUSE [UPLINK]]\n";
  return 2;
}
