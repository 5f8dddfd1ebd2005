// Command indexer-check runs llm-d's KV-cache indexer as its precise prefix-cache scorer does: a ZeroMQ
// subscriber (bound at ENDPOINT, the engines connect to it), the vLLM event adapter, the event pool and an
// in-memory block index, all llm-d-kv-cache's own code (built inside its module by
// e2e/build_llmd_indexer_check.sh). It then answers lookups on stdin, one JSON object a line:
//
//	{"model": "tiny", "tokens": [1, 2, ...], "extra": [["k"], null]}  ->  {"pods": [["pod-a"], ["pod-a"], []]}
//
// the pods the index holds for each of the prompt's full blocks (llm-d's request keys, computed from the
// tokens and, when given, each block's extra keys as llm-d reads them from events: strings, which it
// takes for multimodal hashes), in order; an empty list where the index has none.
//
// Usage: indexer-check ENDPOINT BLOCK_SIZE
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"

	"k8s.io/apimachinery/pkg/util/sets"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
)

type lookup struct {
	Model  string     `json:"model"`
	Tokens []uint32   `json:"tokens"`
	Extra  [][]string `json:"extra"`
}

func features(extra [][]string) []*kvblock.BlockExtraFeatures {
	if extra == nil {
		return nil
	}
	out := make([]*kvblock.BlockExtraFeatures, len(extra))
	for i, keys := range extra {
		if keys != nil {
			out[i] = &kvblock.BlockExtraFeatures{}
			for _, k := range keys {
				out[i].MMHashes = append(out[i].MMHashes, kvblock.MMHash{Hash: k})
			}
		}
	}
	return out
}

type answer struct {
	Pods  [][]string `json:"pods"`
	Error string     `json:"error,omitempty"`
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: indexer-check ENDPOINT BLOCK_SIZE")
		os.Exit(2)
	}
	blockSize, err := strconv.Atoi(os.Args[2])
	check("block size", err)
	ctx := context.Background()

	index, err := kvblock.NewInMemoryIndex(nil)
	check("index", err)
	tokens, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSizeTokens: blockSize})
	check("token processor", err)
	cfg := kvevents.DefaultConfig()
	cfg.DiscoverPods = false
	pool := kvevents.NewPool(cfg, index, tokens, engineadapter.NewVLLMAdapter())
	pool.Start(ctx)
	// One global socket: bound here (remote=false), the engines connect; topics kv@<pod>@<model>.
	subscribers := kvevents.NewSubscriberManager(pool)
	check("subscriber", subscribers.EnsureSubscriber(ctx, "indexer", os.Args[1], cfg.TopicFilter, false))
	fmt.Println(`{"ready": true}`)

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<24)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var q lookup
		a := answer{Pods: [][]string{}}
		if err := json.Unmarshal(in.Bytes(), &q); err != nil {
			a.Error = err.Error()
		} else if keys, err := tokens.TokensToKVBlockKeys(kvblock.EmptyBlockHash, q.Tokens, q.Model, features(q.Extra)); err != nil {
			a.Error = err.Error()
		} else if len(keys) > 0 {
			found, err := index.Lookup(ctx, keys, sets.New[string]())
			if err != nil {
				a.Error = err.Error()
			}
			for _, k := range keys {
				pods := []string{}
				for _, p := range found[k] {
					pods = append(pods, p.PodIdentifier)
				}
				a.Pods = append(a.Pods, pods)
			}
		}
		check("answer", out.Encode(a))
	}
}

func check(what string, err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "indexer-check: %s: %v\n", what, err)
		os.Exit(1)
	}
}
