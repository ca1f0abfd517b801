// Chats rendered as Ollama renders a Modelfile's TEMPLATE, by Go's own text/template: the check of
// qlora_fsdp/tools/ollama.py that shares none of its code (tests/ollama_go.py builds and runs this).
//
// Reads a JSON list of {"template", "system", "messages"} on stdin, writes the JSON list of rendered prompts.
// What Ollama (server/routes.go, template/template.go) does with a template in the plain form ({{ .System }},
// {{ .Prompt }}, {{ .Response }}; no .Messages), written here from its behaviour:
//   - the template is parsed with missingkey=zero; one that names neither Response nor Messages gets a
//     {{ .Response }} appended;
//   - the Modelfile's SYSTEM goes first where the chat does not begin with a system message;
//   - consecutive messages of one role are joined by a blank line;
//   - the template is executed once per turn (System, Prompt, Response): a turn ends where a user message
//     follows a reply, or a system message follows a prompt or a reply;
//   - the last turn is executed with the template cut after its first {{ .Response }}: the model writes the reply.
package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
	"text/template/parse"
)

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chat struct {
	Template string    `json:"template"`
	System   string    `json:"system"`
	Messages []message `json:"messages"`
}

// turn holds the values one execution of the template sees.
type turn struct{ system, prompt, response string }

func (t turn) values() map[string]any {
	return map[string]any{"System": t.system, "Prompt": t.prompt, "Response": t.response}
}

func main() {
	var chats []chat
	if err := json.NewDecoder(os.Stdin).Decode(&chats); err != nil {
		fail(err)
	}
	rendered := make([]string, len(chats))
	for i, c := range chats {
		text, err := render(c)
		if err != nil {
			fail(err)
		}
		rendered[i] = text
	}
	if err := json.NewEncoder(os.Stdout).Encode(rendered); err != nil {
		fail(err)
	}
}

func fail(err error) {
	os.Stderr.WriteString(err.Error() + "\n")
	os.Exit(1)
}

func render(c chat) (string, error) {
	tmpl, err := parsed(c.Template)
	if err != nil {
		return "", err
	}
	messages := c.Messages
	if c.System != "" && (len(messages) == 0 || messages[0].Role != "system") {
		messages = append([]message{{Role: "system", Content: c.System}}, messages...)
	}
	var out strings.Builder
	var current turn
	for _, m := range collated(messages) {
		ends := (m.Role == "system" && (current.prompt != "" || current.response != "")) ||
			(m.Role == "user" && current.response != "")
		if ends {
			if err := tmpl.Execute(&out, current.values()); err != nil {
				return "", err
			}
			current = turn{}
		}
		switch m.Role {
		case "system":
			current.system = m.Content
		case "user":
			current.prompt = m.Content
		case "assistant":
			current.response = m.Content
		}
	}
	root := tmpl.Tree.Root.CopyList()
	cutAfterResponse(root)
	last, err := template.New("").AddParseTree("", &parse.Tree{Root: root})
	if err != nil {
		return "", err
	}
	err = last.Execute(&out, current.values())
	return out.String(), err
}

func parsed(source string) (*template.Template, error) {
	funcs := template.FuncMap{"json": func(v any) string { b, _ := json.Marshal(v); return string(b) }}
	tmpl, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(source)
	if err != nil {
		return nil, err
	}
	names := map[string]bool{}
	identifiers(tmpl.Tree.Root, names)
	if !names["response"] && !names["messages"] {
		response := template.Must(template.New("").Parse("{{ .Response }}")).Tree.Root.Nodes[0]
		tmpl.Tree.Root.Nodes = append(tmpl.Tree.Root.Nodes, response)
	}
	return tmpl, nil
}

func collated(messages []message) []message {
	var joined []message
	for _, m := range messages {
		if n := len(joined); n > 0 && joined[n-1].Role == m.Role {
			joined[n-1].Content += "\n\n" + m.Content
		} else {
			joined = append(joined, m)
		}
	}
	return joined
}

// identifiers adds the (lower-cased) field and variable names a node uses to `names`.
func identifiers(node parse.Node, names map[string]bool) {
	switch n := node.(type) {
	case *parse.ListNode:
		if n != nil {
			for _, child := range n.Nodes {
				identifiers(child, names)
			}
		}
	case *parse.ActionNode:
		identifiers(n.Pipe, names)
	case *parse.TemplateNode:
		identifiers(n.Pipe, names)
	case *parse.IfNode:
		branchIdentifiers(&n.BranchNode, names)
	case *parse.RangeNode:
		branchIdentifiers(&n.BranchNode, names)
	case *parse.WithNode:
		branchIdentifiers(&n.BranchNode, names)
	case *parse.PipeNode:
		if n != nil {
			for _, command := range n.Cmds {
				for _, arg := range command.Args {
					identifiers(arg, names)
				}
			}
		}
	case *parse.FieldNode:
		for _, ident := range n.Ident {
			names[strings.ToLower(ident)] = true
		}
	case *parse.VariableNode:
		for _, ident := range n.Ident {
			names[strings.ToLower(ident)] = true
		}
	}
}

func branchIdentifiers(b *parse.BranchNode, names map[string]bool) {
	identifiers(b.Pipe, names)
	identifiers(b.List, names)
	if b.ElseList != nil {
		identifiers(b.ElseList, names)
	}
}

// cutAfterResponse drops what the list writes after its first {{ .Response }} (which stays: empty, or the reply
// being continued); true once that action was found.
func cutAfterResponse(list *parse.ListNode) bool {
	if list == nil {
		return false
	}
	for i, node := range list.Nodes {
		if writesResponse(node) {
			list.Nodes = list.Nodes[:i+1]
			return true
		}
	}
	return false
}

func writesResponse(node parse.Node) bool {
	switch n := node.(type) {
	case *parse.ActionNode:
		return pipeNamesResponse(n.Pipe)
	case *parse.IfNode:
		return cutBranch(&n.BranchNode)
	case *parse.RangeNode:
		return cutBranch(&n.BranchNode)
	case *parse.WithNode:
		return cutBranch(&n.BranchNode)
	}
	return false
}

// cutBranch cuts inside a branch's body or else-part (a branch's condition writes nothing, so it is not looked at).
func cutBranch(b *parse.BranchNode) bool {
	if cutAfterResponse(b.List) {
		b.ElseList = nil
		return true
	}
	return cutAfterResponse(b.ElseList)
}

func pipeNamesResponse(pipe *parse.PipeNode) bool {
	for _, command := range pipe.Cmds {
		for _, arg := range command.Args {
			if field, ok := arg.(*parse.FieldNode); ok {
				for _, ident := range field.Ident {
					if ident == "Response" {
						return true
					}
				}
			}
		}
	}
	return false
}
